"""`vx inspect OUT --watch`: a whole run's progress from anywhere, from what its writers publish.

Reads each writer's progress record (vx/store/progress_log.py) and end marker, local or on S3,
any number of partitions on any number of nodes, never a shard body. Each poll gives the
aggregate (done of total, rate, ETA), every partition's rate, and flags: a partition that has
stopped advancing for longer than `stall_after` seconds (its process gone, its record not
updated, or alive and not advancing), one whose bad records grew, one that failed. The watch ends
when every partition's end marker is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vx.store.progress_log import read_progress


@dataclass
class Poll:
    ended: bool
    partitions: int | None
    samples: int = 0
    total: int | None = None
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float | None = None
    eta_s: float | None = None
    rows: list[dict] = field(default_factory=list)  # per partition: name, state, samples, rate, flags
    flags: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"ended": self.ended, "partitions": self.partitions, "samples": self.samples, "total": self.total,
                "samples_per_s": round(self.samples_per_s, 3), "tokens_per_s": round(self.tokens_per_s, 1),
                "mfu": self.mfu, "eta_s": self.eta_s, "rows": self.rows, "flags": self.flags}


class Watch:
    def __init__(self, path: str, endpoint_url: str | None = None, stall_after: float = 300.0):
        from vx.store.stream import Source

        self.path, self.stall_after = path, stall_after
        self.src = Source(path, endpoint_url)
        self._bad: dict[str, int] = {}

    def poll(self) -> Poll:
        from vx.store.format import part_name

        pub = read_progress(self.path, src=self.src)
        n = pub["partitions"]
        names = [part_name(i, n) for i in range(n)] if n else [""]
        ended = bool(pub["writers"] or pub["ended"]) and all(x in pub["ended"] for x in names)
        p = Poll(ended, n)
        now = time.time()
        totals, mfu_num, mfu_den = [], 0.0, 0.0
        for name in names:
            rec = pub["writers"].get(name)
            label = name or "run"
            if rec is None:
                p.rows.append({"partition": label, "state": "waiting", "samples": 0, "samples_per_s": 0.0})
                totals.append(None)
                continue
            state = "done" if name in pub["ended"] else rec.get("state", "?")
            row = {"partition": label, "state": state, "samples": rec.get("samples", 0),
                   "total": rec.get("total_samples"), "samples_per_s": 0.0, "tokens_per_s": 0.0,
                   "mfu": rec.get("mfu"), "bad_records": rec.get("bad_records", 0), "host": rec.get("host"),
                   "pid": rec.get("pid"), "record_age_s": round(now - rec.get("updated", now), 1)}
            if state not in ("done", "failed"):
                quiet = now - (rec.get("last_advance") or rec.get("started") or now)
                if row["record_age_s"] > self.stall_after or (state == "running" and quiet > self.stall_after):
                    row["state"] = state = "stalled"
                    p.flags.append(f"{label}: stalled, no sample done for {quiet:,.0f} s (record "
                                   f"{row['record_age_s']:,.0f} s old, pid {rec.get('pid')} on {rec.get('host')})")
                else:
                    row.update(samples_per_s=rec.get("samples_per_s", 0.0), tokens_per_s=rec.get("tokens_per_s", 0.0))
                    if rec.get("mfu") is not None and rec.get("tokens_per_s"):
                        mfu_num += rec["tokens_per_s"]
                        mfu_den += rec["tokens_per_s"] / rec["mfu"] if rec["mfu"] else 0.0
            if state == "failed":
                p.flags.append(f"{label}: failed (pid {rec.get('pid')} on {rec.get('host')}; see its log)")
            bad = row["bad_records"] or 0
            if bad > self._bad.get(name, bad):
                p.flags.append(f"{label}: bad records grew to {bad:,} (+{bad - self._bad[name]:,})")
            self._bad[name] = bad
            p.rows.append(row)
            p.samples += row["samples"]
            p.samples_per_s += row["samples_per_s"]
            p.tokens_per_s += row["tokens_per_s"]
            totals.append(None if state == "done" and row["total"] is None else
                          row["samples"] if state == "done" else row["total"])
        if all(t is not None for t in totals):
            p.total = sum(totals)
            left = max(0, p.total - p.samples)
            p.eta_s = 0.0 if not left else round(left / p.samples_per_s, 1) if p.samples_per_s else None
        if mfu_den:  # the running partitions' MFU, weighted by the peak behind each
            p.mfu = round(mfu_num / mfu_den, 5)
        return p

    def run(self, interval: float, show) -> Poll:
        """Poll every `interval` seconds, show(poll) each time, until the run has ended."""
        while True:
            poll = self.poll()
            show(poll)
            if poll.ended:
                return poll
            time.sleep(interval)
