"""`vx extract --retain-gb G`: shards every follow reader has consumed are deleted, and the
extraction waits while the shards nobody has consumed yet would exceed G.

Readers record what they consumed beside the output (`.vx-readers/rank-R-of-W.json`, written by
`vx.loader(..., follow=True).commit(state)` once the trainer's checkpoint is durable): a count of
stream positions (vx/store/stream.py), every reader in the same order. A shard at position q is
consumed when every rank 0..W-1 has recorded more than q. The retainer, a thread beside each
writer (one per partition), deletes its own consumed shards (the S3 object and the local file),
and lists them in the partition's dropped.jsonl; the manifest keeps them (they stay committed, so
a rerun never redoes their samples). The bound itself is the writer's local backpressure: with
--retain-gb the writer of each of P partitions waits while its undeleted shards + the next one
exceed G / P, and shards uploaded to S3 stay on the local disk until consumed, so the S3 prefix
never holds more than the local disk. Nothing a reader has not committed is deleted.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from vx import faults
from vx.store.format import DROPPED, READERS, RETAIN
from vx.store.stream import Stream
from vx.store.uploader import RETAIN_FAILED, local_shard_bytes


def reader_records(stream: Stream) -> list[dict]:
    """Every reader's consumption record under the output (local directory or S3 prefix)."""
    src = stream.src
    out = []
    if src.remote:
        pages = src.client.get_paginator("list_objects_v2").paginate(Bucket=src.target.bucket,
                                                                      Prefix=src.target.key(READERS + "/"))
        keys = [o["Key"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(".json")]
        for key in keys:
            out.append(json.loads(src.client.get_object(Bucket=src.target.bucket, Key=key)["Body"].read()))
        return out
    d = Path(src.path) / READERS
    for f in sorted(d.glob("rank-*.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def consumed_by_all(records: list[dict]) -> tuple[int, str]:
    """Stream positions every rank has consumed, and a line saying who holds it back."""
    if not records:
        return 0, "no reader has committed yet"
    world = max(r["world_size"] for r in records)
    by_rank = {r["rank"]: r["consumed"] for r in records if r["world_size"] == world}
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        return 0, f"ranks {missing} of {world} have not committed yet"
    low = min(by_rank.values())
    return low, f"the slowest of {world} ranks has consumed {low} positions"


def start_retainer(out, root, retain_gb: float, writers: int, budget: int) -> "Retainer":
    """--retain-gb for the writer of Output out (root: its run's root output, out itself when not
    a partition): the bound recorded for readers (retain.json), then the thread that deletes its
    consumed shards."""
    part = out.local.name if out is not root else ""
    where = str(root.target) if root.target is not None else str(root.local)
    root.put_small(RETAIN, {"retain_gb": retain_gb, "writers": writers})
    return Retainer(where, out.endpoint_url, part, out.local, budget, fence=out.fence).start()


class Retainer:
    """Deletes this writer's consumed shards (see the module docstring); a daemon thread."""

    def __init__(self, root: str, endpoint_url: str | None, part: str, local_dir: Path, budget: int,
                 poll: float = 0.5, fence=None):
        self.stream = Stream(root, endpoint_url)
        self.fence = fence  # the writer's hold on its S3 prefix: checked before each write there
        self.part, self.local_dir, self.budget, self.poll = part, Path(local_dir), budget, poll
        self.dropped: list[str] = []
        self.dropped_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vx-retainer", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "Retainer":
        self.stream.refresh()
        prefix = f"{self.part}/" if self.part else ""
        self.dropped = sorted(n[len(prefix):] for n in self.stream.dropped() if n.startswith(prefix)
                              and "/" not in n[len(prefix):])
        (self.local_dir / RETAIN_FAILED).unlink(missing_ok=True)
        self._finish_drops(prefix)
        self._thread.start()
        return self

    def _finish_drops(self, prefix: str) -> None:
        """Delete what an earlier run listed as dropped but did not delete before it died: left in
        place, those files would count against the bound forever and the writer would wait for room
        that no reader can free (found by the fault campaign: a kill between listing and deleting)."""
        for name in self.dropped:
            (self.local_dir / name).unlink(missing_ok=True)
        src = self.stream.src
        if src.remote and self.dropped:
            self._check()
            keys = [{"Key": src.target.key(prefix + n)} for n in self.dropped]
            for i in range(0, len(keys), 1000):  # idempotent: deleting a deleted key is a success
                src.client.delete_objects(Bucket=src.target.bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})

    def _run(self) -> None:
        said = 0.0
        try:
            while not self._stop.wait(self.poll):
                self.stream.refresh()
                upto, who = consumed_by_all(reader_records(self.stream))
                done = set(self.dropped)
                new = []
                for q in range(min(upto, len(self.stream))):
                    rec = self.stream.record(q)
                    head, _, name = rec["shard"].rpartition("/")
                    if head == self.part and name not in done:
                        new.append(rec)
                if new:
                    self._drop(new)
                held = local_shard_bytes(self.local_dir)
                if held >= self.budget and time.monotonic() - said > 60:
                    said = time.monotonic()
                    print(f"vx: --retain-gb: {held / 1e9:.2f} GB of unconsumed shards fill this writer's "
                          f"{self.budget / 1e9:.2f} GB; extraction waits for readers ({who})", file=sys.stderr)
        except BaseException as e:  # surfaced by stop(); a writer waiting for room stops on the marker
            self.error = e
            (self.local_dir / RETAIN_FAILED).write_text(f"{type(e).__name__}: {e}\n")


    def _drop(self, records: list[dict]) -> None:
        """List the shards as dropped first (local and S3), then delete them: a crash in between
        leaves a listed shard undeleted (harmless), never a deleted one unlisted (a rerun would
        take it for lost and redo its samples)."""
        src = self.stream.src
        self.dropped += [rec["shard"].rpartition("/")[2] for rec in records]
        body = "".join(json.dumps({"shard": n}) + "\n" for n in self.dropped)
        tmp = self.local_dir / f".{DROPPED}.tmp"
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.local_dir / DROPPED)
        if src.remote:
            self._check()
            key = f"{self.part}/{DROPPED}" if self.part else DROPPED
            src.client.put_object(Bucket=src.target.bucket, Key=src.target.key(key), Body=body.encode())
        faults.point("before-retain-delete")
        for rec in records:
            if src.remote:
                src.client.delete_object(Bucket=src.target.bucket, Key=src.target.key(rec["shard"]))
            (self.local_dir / rec["shard"].rpartition("/")[2]).unlink(missing_ok=True)
            faults.point("after-retain-delete")
            self.dropped_bytes += rec["bytes"]

    def _check(self) -> None:
        if self.fence is not None:
            self.fence.check()

    def stop(self, raise_error: bool = True) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and raise_error:
            raise self.error
