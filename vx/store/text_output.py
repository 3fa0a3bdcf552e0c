"""The output of `vx regenerate`: one append-only JSONL file, committed in fsynced chunks.

A single run writes OUTPUT (and OUTPUT.errors.jsonl, OUTPUT.vllm.log beside it). A partitioned
run (--data-parallel-size, --ray, --num-partitions/--partition-index) writes each partition to
OUTPUT.parts/part-i-of-P.jsonl with its own sidecars; when every partition is done the launcher
(or the same command run again without --partition-index) merges them into OUTPUT: each
conversation once, whatever crashed where, and removes the merged parts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from vx import faults
from vx.errors import UsageError
from vx.store.format import part_name
from vx.store.lock import try_lock, write_atomically


COMMITTED = ".committed"  # OUTPUT.committed: OUTPUT's size when its last chunk was fsynced (vx/data/follow.py reads it)


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def part_path(output: Path, index: int, count: int) -> Path:
    return parts_dir(output) / f"{part_name(index, count)}.jsonl"


def sidecar(path: Path, suffix: str) -> Path:
    """OUTPUT.errors.jsonl, OUTPUT.vllm.log, OUTPUT.lock."""
    return path.with_name(path.name + suffix)


def committed_ids(path: Path) -> set[str]:
    """Ids of the whole lines of a regenerate output (a torn last line is not committed)."""
    if not path.exists():
        return set()
    with open(path, "rb") as f:
        return {str(json.loads(line)["id"]) for line in f if line.endswith(b"\n") and line.strip()}


def looks_finished(path: Path, records: Callable[[], int]) -> bool:
    """Whether an earlier run wrote or reported every record of its input (records(): how many) to
    OUTPUT at path (its lines and its errors file's), by count: read before any engine, so that a
    rerun with nothing to generate can skip one. A guess: a record dropped (--drop-truncated) counts
    as work; a wrong "finished" (records changed since) only orders the engines' starts, the
    regeneration still finds its work."""
    if not path.exists() or not path.stat().st_size:
        return False  # a first run: nothing read
    errors = sidecar(path, ".errors.jsonl")
    written = len(committed_ids(path)) + (sum(1 for _ in open(errors, "rb")) if errors.exists() else 0)
    return written >= records()


MERGE_WAIT_S = 300.0  # a part's writer waits this long for a merge that holds its lock (a rerun's
# partition starting as another one, with nothing left to do, merges the parts a crash left behind)


def merging(output: Path) -> bool:
    """Whether a live process is merging parts into OUTPUT now (it holds OUTPUT.lock)."""
    lock, holder = try_lock(sidecar(output, ".lock"))
    if lock is not None:
        lock.close()
    return holder is not None


def take_lock(path: Path, who: str, wait=lambda: True):
    """path's writer lock (path.lock), its holder waited for while wait() (up to MERGE_WAIT_S);
    else one line naming the holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + MERGE_WAIT_S
    lock, holder = try_lock(sidecar(path, ".lock"))
    while holder and wait() and time.monotonic() < deadline:
        time.sleep(0.2)
        lock, holder = try_lock(sidecar(path, ".lock"))
    if holder:
        raise UsageError(f"{path} is being written by another {who} ({holder})")
    return lock


class RegenOutput:
    """One output file (OUTPUT or a partition's part) and its errors file; the ids already
    written there (and, for a part, in the merged OUTPUT)."""

    def __init__(self, path: Path, merged: Path | None = None):
        self.path = path
        # a merge holds the parts' locks for a moment: the part is free after it
        self._lock = take_lock(path, "vx regenerate", wait=lambda: merged is not None and merging(merged))
        self.done = self._recover() | (committed_ids(merged) if merged is not None else set())
        self._f = open(path, "ab")
        self.errors = open(sidecar(path, ".errors.jsonl"), "w")
        self._pending: list[bytes] = []
        self._last = time.monotonic()
        self.written = 0

    def _recover(self) -> set[str]:
        """Drop a torn last line (a crash mid-append), return the ids already committed."""
        if not self.path.exists():
            return set()
        truncate_torn(self.path)
        mark_committed(self.path)
        return committed_ids(self.path)

    def add(self, record: dict, every: int) -> None:
        self._pending.append(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        if len(self._pending) >= every or time.monotonic() - self._last > 2.0:
            self.commit()

    def commit(self) -> None:
        if self._pending:
            # taken out before the write: a failure below must not leave them to close(), which
            # would write them a second time (found by the fault campaign: ENOSPC before the mark)
            chunk, n = b"".join(self._pending), len(self._pending)
            self._pending.clear()
            self._f.write(chunk)
            self._f.flush()
            faults.point("before-chunk-fsync")
            os.fsync(self._f.fileno())
            faults.point("before-committed-mark")
            mark_committed(self.path)
            self.written += n
            faults.point("after-chunk")
        self._last = time.monotonic()

    def close(self) -> None:
        self.commit()
        self._f.close()
        self.errors.close()
        self._lock.close()


def mark_committed(path: Path) -> None:
    """PATH.committed: path's durable size (vx/data/follow.py reads no further), replaced atomically."""
    write_atomically(sidecar(path, COMMITTED), str(path.stat().st_size))


def truncate_torn(path: Path) -> None:
    """Cut a file back to its last newline (what a crash mid-append leaves), durably."""
    size = path.stat().st_size
    if not size:
        return
    with open(path, "r+b") as f:
        keep = size
        while keep > 0:  # scan back from the end in blocks for the last newline
            start = max(0, keep - (1 << 16))
            f.seek(start)
            block = f.read(keep - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            keep = start
        if keep < size:
            f.truncate(keep)
            os.fsync(f.fileno())


def merge_leftover_parts(output: Path) -> int:
    """Parts an earlier partitioned run left (a crash before its merge) merged into OUTPUT, whatever
    their partition count: a run of the whole input counts OUTPUT's conversations as done, and
    theirs would be regenerated with other text. Returns the conversations added."""
    import re

    counts = {int(m.group(1)) for p in parts_dir(output).glob("part-*-of-*.jsonl")
              if (m := re.fullmatch(r"part-\d+-of-(\d+)\.jsonl", p.name))}
    return sum(merge_parts(output, count)["merged"] for count in sorted(counts))


def merge_parts(output: Path, count: int) -> dict:
    """Append every part's conversations that OUTPUT lacks to OUTPUT (fsynced), gather the parts'
    errors into OUTPUT.errors.jsonl, then remove the parts. Idempotent: a crash anywhere leaves
    OUTPUT with each id at most once and the parts in place for the next merge."""
    lock, holder = try_lock(sidecar(output, ".lock"))
    if holder:
        raise UsageError(f"{output} is being written by another vx regenerate ({holder})")
    try:
        if output.exists():
            truncate_torn(output)
        have = committed_ids(output)
        parts = [part_path(output, i, count) for i in range(count)]
        if not any(p.exists() or sidecar(p, ".errors.jsonl").exists() for p in parts):
            return {"merged": 0, "conversations": len(have), "complete": True}  # merged before
        added, held = 0, []
        errors_path = sidecar(output, ".errors.jsonl")  # kept: the errors of parts an earlier merge took
        reported = set(errors_path.read_bytes().splitlines(keepends=True)) if errors_path.exists() else set()
        with open(output, "ab") as out, open(errors_path, "ab") as errors:
            for part in parts:
                part_lock, writer = try_lock(sidecar(part, ".lock"))
                if writer:  # a worker is still writing it (a rerun): its own merge takes it later
                    continue
                held.append((part, part_lock))
                if part.exists():
                    with open(part, "rb") as f:
                        for line in f:
                            if not line.endswith(b"\n") or not line.strip():
                                continue
                            sid = str(json.loads(line)["id"])
                            if sid not in have:
                                out.write(line)
                                have.add(sid)
                                added += 1
                part_errors = sidecar(part, ".errors.jsonl")
                if part_errors.exists():  # each bad record once, however many merges
                    for line in part_errors.read_bytes().splitlines(keepends=True):
                        if line.endswith(b"\n") and line not in reported:
                            errors.write(line)
                            reported.add(line)
            out.flush()
            os.fsync(out.fileno())
            faults.point("after-merge")
        for part, part_lock in held:
            for p in (part, sidecar(part, ".errors.jsonl"), sidecar(part, ".done")):
                p.unlink(missing_ok=True)
            part_lock.close()
        return {"merged": added, "conversations": len(have), "complete": len(held) == len(parts)}
    finally:
        lock.close()
