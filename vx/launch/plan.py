"""Partitions: a deterministic, token-balanced split of a dataset into P parts.

A row's weight is its token count under the run's tokenizer and length policy (0 for a row
that does not tokenize: it costs no compute). Lines go, in file order, to the partition with the
fewest tokens so far (ties: the lowest index), so partitions differ by at most one sample's
tokens and each one mixes the whole file (a length-sorted dataset is spread, not cut in ranges).

Weights depend on each line alone, never on its neighbours or on how the work was split across
processes, so every process on every machine computes the same plan for the same dataset
bytes, tokenizer, length policy and P. The plan is cached beside the output (`.vx-plan/`);
the launchers compute it once and hand it to their workers. A plan's token counts also size a
vLLM engine (engine_lengths, max_model_len_for).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import socket
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from vx import faults
from vx.data.formats import TEXT, parse_line, sniff
from vx.data.inputs import Input, InputFile
from vx.data.samples import Reading, Tokenize, tokenize_for
from vx.store.format import PLAN_DIR

PLAN_VERSION = 2  # 2: rows of any input format, reading options in the key
_PARALLEL_MIN_BYTES = 4 << 20  # below this, one process is faster than starting a pool


def assign(weights: list[int], count: int) -> list[int]:
    """Greedy least-loaded assignment in order; returns the partition of each weight."""
    heap = [(0, p) for p in range(count)]
    out = []
    for w in weights:
        load, p = heapq.heappop(heap)
        out.append(p)
        heapq.heappush(heap, (load + w, p))
    return out


def line_weights(source: Input | str | Path, model_dir: Path, reading: Reading = Reading(),
                 procs: int | None = None) -> np.ndarray:
    """Token count of every row of the input (-1 for blank JSONL lines), in parallel: a large
    local plain-JSONL file in byte chunks cut at line starts, any other file as one task."""
    source = source if isinstance(source, Input) else Input(source)
    procs = procs or min(os.cpu_count() or 1, 32)
    tasks = []
    for f in source.files:
        plain = not f.name.startswith("s3://") and sniff(source.head(f, 8)) == TEXT
        if plain and procs > 1 and f.size >= _PARALLEL_MIN_BYTES:
            bounds = _chunk_bounds(Path(f.name), f.size, procs)
            tasks += [(f, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            tasks.append((f, None, None))
    args = [(source.endpoint_url, str(model_dir), reading, f, a, b) for f, a, b in tasks]
    if procs <= 1 or len(tasks) == 1:
        parts = [_task_weights(*a) for a in args]
    else:
        with ProcessPoolExecutor(min(procs, len(tasks)), mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_task_weights, *zip(*args)))
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)


def _chunk_bounds(path: Path, size: int, procs: int) -> list[int]:
    """Byte offsets cutting the file into ~equal chunks at line starts."""
    bounds = [0]
    with open(path, "rb") as f:
        for k in range(1, procs):
            f.seek(size * k // procs)
            f.readline()
            pos = f.tell()
            if bounds[-1] < pos < size:
                bounds.append(pos)
    return bounds + [size]


def _task_weights(endpoint_url, model_dir: str, reading: Reading, f: InputFile, start, end) -> list[int]:
    tokenize = tokenize_for(Path(model_dir), reading)
    if start is None:
        rows = Input(f.name, endpoint_url, files=[f]).file_rows(f)
        return [-1 if rec is None and bad is None else _weight(tokenize, rec) for _, rec, bad in rows]
    out = []
    with open(f.name, "rb") as fh:
        fh.seek(start)
        while fh.tell() < end:
            raw = fh.readline()
            if not raw:
                break
            out.append(-1 if not raw.strip() else _weight(tokenize, raw))
    return out


def _weight(tokenize: Tokenize, rec) -> int:
    """Tokens of one row under the length policy; 0 for a bad row (reported by the partition
    that owns it, costs nothing)."""
    if rec is None:
        return 0
    try:
        return len(tokenize.sample(rec if isinstance(rec, dict) else parse_line(rec))[0])
    except Exception:
        return 0


def plan_key(source: Input, model_fingerprint: str, reading: Reading, count: int) -> str:
    h = hashlib.sha256(source.fingerprint().encode())
    h.update(json.dumps([PLAN_VERSION, model_fingerprint, reading.key(), count]).encode())
    return h.hexdigest()[:24]


def make_plan(source: Input | str | Path, model_dir: Path, count: int, reading: Reading = Reading(),
              procs: int | None = None, weights: np.ndarray | None = None) -> np.ndarray:
    """Partition index of every row (-1: blank line), int32 [rows]."""
    weights = line_weights(source, model_dir, reading, procs) if weights is None else weights
    plan = np.full(len(weights), -1, dtype=np.int32)
    real = np.flatnonzero(weights >= 0)
    plan[real] = assign(weights[real].tolist(), count)
    return plan


def tokens_file(plan_file: Path) -> Path:
    """Beside each plan: every row's token count under the run's length policy (-1: blank)."""
    return Path(plan_file).with_suffix(".tokens.npy")


def _drop_dead_makers(plan_dir: Path) -> None:
    """Remove temp files of plan makers on this host that died before their rename (a kill -9):
    their pid is in the name; another live maker's, or another host's, are left alone."""
    host = socket.gethostname()
    for tmp in plan_dir.glob(f"*.{host}.*.tmp"):
        pid = tmp.name[:-len(".tmp")].rpartition(".")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def load_or_make_plan(root: Path, source: Input, model_dir: Path, fingerprint: str, count: int,
                      reading: Reading) -> Path:
    """The plan file for this input/tokenizer/reading/P under root/.vx-plan, made if missing,
    with the rows' token counts beside it (tokens_file)."""
    path = Path(root) / PLAN_DIR / f"plan-{plan_key(source, fingerprint, reading, count)}.npy"
    if path.exists() and tokens_file(path).exists():
        return path
    weights = line_weights(source, model_dir, reading)
    plan = make_plan(source, model_dir, count, reading, weights=weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_dead_makers(path.parent)
    for target, array in ((tokens_file(path), weights), (path, plan)):  # the plan last: it marks both done
        tmp = target.with_suffix(f".{socket.gethostname()}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:  # concurrent makers write identical bytes; rename is atomic
                np.save(f, array)
            faults.point("before-plan-publish")
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def sample_lengths(plan_file: Path, index: int | None = None) -> np.ndarray | None:
    """Tokens of each row of partition `index` (every partition: None), in line order, rows
    without tokens left out; None for a plan made without its token counts."""
    if not tokens_file(plan_file).exists():
        return None
    weights = np.load(tokens_file(plan_file))
    if index is not None:
        weights = weights[np.load(plan_file) == index]
    return weights[weights > 0]


def lines_of(plan_file: Path, index: int) -> set[int]:
    """1-based row numbers of partition `index`."""
    plan = np.load(plan_file)
    return set((np.flatnonzero(plan == index) + 1).tolist())


def spread(tokens: list[int]) -> float:
    """(max - min) / mean of the tokens per partition: 0 is a perfect balance."""
    mean = sum(tokens) / len(tokens) if tokens else 0
    return (max(tokens) - min(tokens)) / mean if mean else 0.0


def balance(plan: np.ndarray, weights: np.ndarray, count: int) -> dict:
    """Tokens per partition and their spread."""
    tokens = [int(weights[(plan == p) & (weights > 0)].sum()) for p in range(count)]
    return {"tokens": tokens, "spread": spread(tokens)}


def engine_lengths(plan: Path | None, output, source, model_dir, fingerprint: str, reading: Reading,
                   index: int | None) -> np.ndarray | None:
    """The token counts of the rows a run (partition `index`) submits, in order, from its plan (a
    one-partition plan under output is made for a single run); None for a plan made without them."""
    if plan is None:
        plan = load_or_make_plan(output, source, model_dir, fingerprint, 1, reading)
    return sample_lengths(plan, index)


def max_model_len_for(lengths: np.ndarray | None, limit: int | None) -> int | None:
    """The engine's max_model_len: the longest sample a run submits, + 1 (the engine samples one
    token), never more than the model's own (limit). vLLM's default is the model's (262,144 for
    Qwen3.6), and the engine refuses to start where one such request, with capture's per-token
    cost, does not fit."""
    if lengths is None or not len(lengths):
        return None
    want = max(int(lengths.max()), 2) + 1  # a 1-token sample is sent as 2 tokens (vllm_backend.prompt_ids)
    return min(want, limit) if limit else want
