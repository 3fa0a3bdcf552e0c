"""Partitions: a deterministic, token-balanced split of a dataset into P parts.

A line's weight is its token count under the run's tokenizer and length policy (0 for a line
that does not tokenize: it costs no compute). Lines go, in file order, to the partition with the
fewest tokens so far (ties: the lowest index), so partitions differ by at most one sample's
tokens and each one mixes the whole file (a length-sorted dataset is spread, not cut in ranges).

Weights depend on each line alone, never on its neighbours or on how the work was split across
processes, so every process on every machine computes the same plan for the same dataset
bytes, tokenizer, length policy and P. The plan is cached beside the output (`.vx-plan/`);
the launchers compute it once and hand it to their workers.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

PLAN_VERSION = 1
PLAN_DIR = ".vx-plan"
_PARALLEL_MIN_BYTES = 4 << 20  # below this, one process is faster than starting a pool


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def assign(weights: list[int], count: int) -> list[int]:
    """Greedy least-loaded assignment in order; returns the partition of each weight."""
    heap = [(0, p) for p in range(count)]
    out = []
    for w in weights:
        load, p = heapq.heappop(heap)
        out.append(p)
        heapq.heappush(heap, (load + w, p))
    return out


def line_weights(path: Path, model_dir: Path, max_length: int | None, overlong: str,
                 procs: int | None = None) -> np.ndarray:
    """Token count of every physical line of `path` (-1 for blank lines), in parallel chunks."""
    size = os.path.getsize(path)
    procs = procs or min(os.cpu_count() or 1, 32)
    if procs <= 1 or size < _PARALLEL_MIN_BYTES:
        return np.asarray(_chunk_weights(str(path), str(model_dir), 0, size, max_length, overlong), dtype=np.int64)
    bounds = _chunk_bounds(path, size, procs)
    with ProcessPoolExecutor(len(bounds) - 1, mp_context=get_context("spawn")) as pool:
        parts = pool.map(_chunk_weights, [str(path)] * (len(bounds) - 1), [str(model_dir)] * (len(bounds) - 1),
                         bounds[:-1], bounds[1:], [max_length] * (len(bounds) - 1), [overlong] * (len(bounds) - 1))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


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


def _chunk_weights(path: str, model_dir: str, start: int, end: int, max_length, overlong) -> list[int]:
    from .dataset import Tokenize
    from .model import load_tokenizer

    tokenize = Tokenize(load_tokenizer(Path(model_dir)))
    out = []
    with open(path, "rb") as f:
        f.seek(start)
        while f.tell() < end:
            raw = f.readline()
            if not raw:
                break
            out.append(-1 if not raw.strip() else _weight(tokenize, raw, max_length, overlong))
    return out


def _weight(tokenize, raw: bytes, max_length, overlong) -> int:
    try:
        rec = json.loads(raw)
        n = len(tokenize(rec)[0]) if isinstance(rec, dict) else 0
    except Exception:  # a bad line: reported by the partition that owns it, costs nothing
        return 0
    if max_length is not None and n > max_length:
        return 0 if overlong == "skip" else max_length
    return n


def plan_key(data: Path, model_fingerprint: str, max_length, overlong: str, count: int) -> str:
    h = hashlib.sha256()
    with open(data, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    h.update(json.dumps([PLAN_VERSION, model_fingerprint, max_length, overlong, count]).encode())
    return h.hexdigest()[:24]


def make_plan(data: Path, model_dir: Path, count: int, max_length, overlong: str,
              procs: int | None = None) -> np.ndarray:
    """Partition index of every physical line (-1: blank line), int32 [lines]."""
    weights = line_weights(data, model_dir, max_length, overlong, procs)
    plan = np.full(len(weights), -1, dtype=np.int32)
    real = np.flatnonzero(weights >= 0)
    plan[real] = assign(weights[real].tolist(), count)
    return plan


def load_or_make_plan(root: Path, data: Path, model_dir: Path, fingerprint: str, count: int, max_length,
                      overlong: str) -> Path:
    """The plan file for this dataset/tokenizer/policy/P under root/.vx-plan, made if missing."""
    path = Path(root) / PLAN_DIR / f"plan-{plan_key(data, fingerprint, max_length, overlong, count)}.npy"
    if path.exists():
        return path
    plan = make_plan(data, model_dir, count, max_length, overlong)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:  # concurrent makers write identical bytes; rename is atomic
        np.save(f, plan)
    os.replace(tmp, path)
    return path


def lines_of(plan_file: Path, index: int) -> set[int]:
    """1-based line numbers of partition `index`."""
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
