"""The output directory: run metadata, resume state, errors file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .shard_file import ERRORS, MANIFEST, RUN_META, read_manifest
from .shards import live_writer, try_lock

# Keys of vx.json that must match for a rerun to continue the same output.
IDENTITY_KEYS = ("model_fingerprint", "layer_ids", "store_dtype", "hidden_size")
LOCK = ".vx-lock"
# A partition's own output directory under the root: part-00003-of-00008/
PART_RE = re.compile(r"^part-\d{5}-of-\d{5}$")


def part_dirs(root: Path) -> list[Path]:
    """Partition outputs under root (any partition count, e.g. an 8-way run resumed 4-way), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and PART_RE.match(p.name))


def output_dirs(root: Path) -> list[Path]:
    """Every directory whose manifest is part of the dataset at root: root itself, then partitions."""
    return [Path(root)] + part_dirs(root)


def committed_ids_under(root: Path, exclude: Path | None = None) -> set[str]:
    """Sample ids committed anywhere in the output at root (root and every partition)."""
    ids: set[str] = set()
    for d in output_dirs(root):
        if exclude is not None and d.resolve() == Path(exclude).resolve():
            continue
        ids.update(sid for r in read_manifest(d) for sid in r["sample_ids"])
    return ids


def check_identity(out: Path, meta: dict) -> None:
    meta_path = Path(out) / RUN_META
    if not meta_path.exists():
        return
    old = json.loads(meta_path.read_text())
    diff = [k for k in IDENTITY_KEYS if old.get(k) != meta.get(k)]
    if diff:
        detail = "; ".join(f"{k}: {old.get(k)!r} there, {meta.get(k)!r} now" for k in diff)
        raise UsageError(f"{out} holds another extraction ({detail}). Use another -o, or --overwrite "
                         "to delete it")


def write_meta(out: Path, meta: dict) -> None:
    tmp = Path(out) / f"{RUN_META}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, Path(out) / RUN_META)


def claim_root(root: Path, meta: dict) -> None:
    """A partition worker joins the output at root: same model/layers/dtype, or refuse."""
    Path(root).mkdir(parents=True, exist_ok=True)
    check_identity(root, meta)
    write_meta(root, meta)


def clear_partitions(root: Path) -> None:
    """--overwrite of a partitioned run: every partition directory and the cached plans go."""
    for d in part_dirs(root):
        shutil.rmtree(d)
    from .partition import PLAN_DIR

    shutil.rmtree(Path(root) / PLAN_DIR, ignore_errors=True)


@dataclass
class ResumeState:
    committed_ids: set[str]
    next_shard: int
    committed_tokens: int


@contextlib.contextmanager
def output_lock(out: Path):
    """One writer per output directory (per partition directory): a second `vx extract` on the
    same one, on this machine, stops at once instead of deleting the first one's pending shards."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    f, holder = try_lock(out / LOCK)
    if holder:
        raise UsageError(f"{out} is being written by another vx extract ({holder}); wait for it or stop it first")
    try:
        yield
    finally:
        f.close()


def prepare_output(out: Path, meta: dict, overwrite: bool) -> ResumeState:
    """Create `out` or continue it. A different model/layers/dtype is refused unless overwrite.
    A directory some live process still writes into (an engine whose driver was killed) is
    refused before anything in it is touched."""
    out = Path(out)
    holder = live_writer(out) if out.exists() else None
    if holder:
        raise UsageError(f"{out} is still being written by {holder}; stop that process first")
    if overwrite and out.exists():
        for name in [MANIFEST, ERRORS, RUN_META]:
            (out / name).unlink(missing_ok=True)
        for f in out.glob("shard-*.safetensors*"):
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / RUN_META
    if meta_path.exists():
        check_identity(out, meta)
    elif any(out.glob("shard-*.safetensors*")) or (out / MANIFEST).exists():
        raise UsageError(f"{out} holds shards but no {RUN_META}; refusing to mix runs (use --overwrite)")
    for tmp in out.glob(".shard-*.tmp"):
        tmp.unlink()
    _repair_manifest(out / MANIFEST)
    records = read_manifest(out)
    committed = {sid for r in records for sid in r["sample_ids"]}
    listed = {r["shard"] for r in records}
    for f in out.glob("shard-*.safetensors*"):  # renamed but never committed: redo its samples
        if f.name not in listed:
            f.unlink()
    next_shard = 1 + max((int(r["shard"][6:11]) for r in records), default=-1)
    write_meta(out, meta)
    return ResumeState(committed, next_shard, sum(r["num_tokens"] for r in records))


def _repair_manifest(path: Path) -> None:
    """Drop a torn last line (a crash mid-append) so new records start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data[: data.rfind(b"\n") + 1]
        with open(path, "wb") as f:
            f.write(keep)
            f.flush()
            os.fsync(f.fileno())


class ErrorLog:
    """errors.jsonl: one record per bad dataset line, rewritten by each run (it is derived data)."""

    def __init__(self, out: Path):
        self.path = Path(out) / ERRORS
        self._f = open(self.path, "w")
        self.count = 0
        self._lock = threading.Lock()  # bad lines come from the reader, rejected states from the writer thread

    def write(self, record: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            self.count += 1

    def close(self) -> None:
        self._f.close()
