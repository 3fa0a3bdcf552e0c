"""Each writer's progress record in the output: what `vx inspect --watch` and `--plot` read.

A writer (a single run, or one partition) keeps two small files in its own directory (the root,
or part-i-of-P/), and under its S3 prefix when it has one:
  progress.json   its latest figures (vx/monitor/meter.py snapshot), replaced every EVERY seconds
  progress.jsonl  every snapshot it took, appended (on S3: put whole every HISTORY_EVERY seconds)
and the final one when it stops, with its state (done or failed; a killed writer's record just
stops being updated). Nothing here reads shard bodies, and a record that cannot be written now
(S3 unreachable) is skipped, never a failure of the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from vx.store.format import END, HISTORY, PROGRESS
from vx.store.lock import drop_dead_temps, write_atomically

EVERY = 5.0           # seconds between records
HISTORY_EVERY = 60.0  # seconds between puts of the history to S3


class ProgressLog:
    """A sink of vx.monitor.meter.Ticker: sink(snapshot, final)."""

    def __init__(self, local: Path, target=None, endpoint_url: str | None = None, every: float | None = None,
                 fence=None):
        self.local, self.target, self.endpoint_url = Path(local), target, endpoint_url
        self.fence = fence  # the writer's hold on its S3 prefix (vx/store/fence.py): checked before a put
        self.every = float(os.environ.get("VX_PROGRESS_RECORD_EVERY", EVERY)) if every is None else every
        self._last = self._last_history = 0.0
        self._client = None
        if self.local.is_dir():  # a writer killed between its write and rename (found by the fault campaign)
            drop_dead_temps(self.local)

    def __call__(self, snap: dict, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < self.every:
            return
        self._last = now
        self.local.mkdir(parents=True, exist_ok=True)
        line = json.dumps(snap) + "\n"
        write_atomically(self.local / PROGRESS, line)
        with open(self.local / HISTORY, "a") as f:
            f.write(line)
        if self.target is None:
            return
        if self.fence is not None:
            self.fence.check()  # a writer that lost its prefix writes no record there
        client = self._s3()
        client.put_object(Bucket=self.target.bucket, Key=self.target.key(PROGRESS), Body=line.encode())
        if final or now - self._last_history >= HISTORY_EVERY:
            self._last_history = now
            client.upload_file(str(self.local / HISTORY), self.target.bucket, self.target.key(HISTORY))

    def _s3(self):
        if self._client is None:  # its own client, few retries: a record is never worth a stall
            from vx.store.s3_client import make_client

            self._client = make_client(self.endpoint_url, attempts=2, connect_timeout=3)
        return self._client


def read_progress(path: str, endpoint_url: str | None = None, history: bool = False, src=None) -> dict:
    """What the writers of the output at `path` (local or s3://) publish, without shard bodies:
    {"writers": {name: latest record}, "partitions": P or None, "ended": {name, ...},
    "history": {name: [records]} (with history=True)}; name "" is the root writer."""
    from vx.store.stream import Source

    src = src or Source(path, endpoint_url)
    names = src.partitions()
    out = {"writers": {}, "partitions": None, "ended": set(), "history": {}}
    for name in [""] + names:
        prefix = f"{name}/" if name else ""
        raw = src.read(prefix + PROGRESS)
        if raw:
            try:
                out["writers"][name] = json.loads(raw.decode().strip().splitlines()[-1])
            except (ValueError, IndexError):
                pass
        if src.read(prefix + END) is not None:
            out["ended"].add(name)
        if history:
            recs = []
            for line in (src.read(prefix + HISTORY) or b"").decode(errors="replace").splitlines():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line
            if recs:
                out["history"][name] = recs
    if names:  # the partitioning the latest writer belongs to (an 8-way run resumed 4-way: 4)
        latest = max((w.get("updated", 0), n) for n, w in out["writers"].items()) if out["writers"] else (0, names[-1])
        out["partitions"] = int((latest[1] or names[-1]).split("-of-")[1])
    return out
