"""An output as an append-only stream of committed shards, read while it is written.

Every reader sees the same order, with no communication: the shards of each writer in its
manifest's order (append-only: a line is a commit), the writers of a partitioned output (any
`part-i-of-N`) interleaved round robin: position order (k, p) for k = 0, 1, ... and partition p
in order. A partition that has ended (its end.json: "shards": K) is skipped for k >= K; one that
has not is waited for. So position q names the same shard for every reader, whenever it looks.

The layout is settled by the first shard or partition directory seen: partition directories of
one count N (all N are then expected), or records in the root manifest (one writer). An output
that mixes them (a run resumed with another partitioning) has no single order while it grows;
follow refuses it (read it once it is complete).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vx.errors import UsageError
from vx.store.format import DROPPED, END, MANIFEST, RUN_META

PART = re.compile(r"^part-(\d{5})-of-(\d{5})$")


class Source:
    """Reads an output's small files: a local directory or an S3 prefix."""

    def __init__(self, path: str, endpoint_url: str | None = None):
        self.path, self.remote = str(path), str(path).startswith("s3://")
        if self.remote:
            from vx.store.s3_client import make_client, parse_s3_url

            self.target, self.client = parse_s3_url(self.path), make_client(endpoint_url)

    def read(self, name: str, start: int = 0) -> bytes | None:
        """The bytes of `name` from `start` on; None when it does not exist."""
        if not self.remote:
            p = Path(self.path) / name
            try:
                with open(p, "rb") as f:
                    f.seek(start)
                    return f.read()
            except FileNotFoundError:
                return None
        from botocore.exceptions import ClientError

        try:
            kw = {"Range": f"bytes={start}-"} if start else {}
            return self.client.get_object(Bucket=self.target.bucket, Key=self.target.key(name), **kw)["Body"].read()
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange":
                return b""
            if code in ("NoSuchKey", "404"):
                return None
            raise

    def partitions(self) -> list[str]:
        """Names of the partition directories under the output."""
        if not self.remote:
            root = Path(self.path)
            return sorted(p.name for p in root.iterdir() if p.is_dir() and PART.match(p.name)) if root.is_dir() else []
        names = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.target.bucket, Prefix=self.target.key(""), Delimiter="/")
        for page in pages:
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(self.target.key("")):].rstrip("/")
                if PART.match(name):
                    names.append(name)
        return sorted(names)


class Stream:
    """The committed shards of an output in the follow order; `refresh()` reads what is new."""

    def __init__(self, path: str, endpoint_url: str | None = None):
        self.src = Source(path, endpoint_url)
        self.meta: dict | None = None
        self.parts: list[str] | None = None     # "" for the root
        self._records: dict[str, list[dict]] = {}
        self._offset: dict[str, int] = {}
        self._end: dict[str, int] = {}          # partition -> its final shard count
        self.order: list[tuple[str, int]] = []  # (partition, k) of each position known so far
        self._k, self._pi = 0, 0                  # the next (k, partition) to place
        self.complete = False

    def _settle(self) -> None:
        if self.meta is None:
            raw = self.src.read(RUN_META)
            if raw is None:
                return
            self.meta = json.loads(raw)
        if self.parts is not None:
            return
        names = self.src.partitions()
        counts = {PART.match(n).group(2) for n in names}
        root = self.src.read(MANIFEST)
        if len(counts) > 1 or (names and root):
            raise UsageError(f"{self.src.path} mixes partitionings ({', '.join(sorted(names)) or 'root'}"
                             f"{' and the root' if names and root else ''}); follow needs one: read it once the "
                             "extraction is complete, without follow")
        if counts:
            n = int(counts.pop())
            self.parts = [f"part-{i:05d}-of-{n:05d}" for i in range(n)]
        elif root or self.src.read(END) is not None:
            self.parts = [""]

    def refresh(self) -> bool:
        """Read new commits and end markers; returns whether the known order grew."""
        self._settle()
        if self.parts is None or self.complete:
            return False
        for p in self.parts:
            name = f"{p}/{MANIFEST}" if p else MANIFEST
            data = self.src.read(name, self._offset.get(p, 0)) or b""
            whole = data[: data.rfind(b"\n") + 1]
            self._offset[p] = self._offset.get(p, 0) + len(whole)
            recs = self._records.setdefault(p, [])
            for line in whole.decode().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    recs.append(dict(rec, shard=f"{p}/{rec['shard']}" if p else rec["shard"]))
            if p not in self._end:
                end = self.src.read(f"{p}/{END}" if p else END)
                if end is not None:
                    self._end[p] = json.loads(end)["shards"]
                    if len(recs) < self._end[p]:  # the end was written after lines we have not read yet
                        del self._end[p]
        before = len(self.order)
        self._extend()
        return len(self.order) > before

    def _extend(self) -> None:
        """Grow the known order up to the first position not committed yet."""
        while not self.complete:
            if all(p in self._end and self._k >= self._end[p] for p in self.parts):
                self.complete = True
                return
            p = self.parts[self._pi]
            if self._k < len(self._records.get(p, [])):
                self.order.append((p, self._k))
            elif p not in self._end:
                return  # shard k of p is not committed yet: every reader waits here
            self._pi += 1  # (a partition that ended before k is skipped)
            if self._pi == len(self.parts):
                self._pi, self._k = 0, self._k + 1

    def dropped(self, parts: list[str] | None = None) -> set[str]:
        """Shards deleted by --retain-gb (names as in the records: partition/shard), in the
        stream's partitions or in `parts` ("" for the root)."""
        names: set[str] = set()
        for p in parts if parts is not None else self.parts or []:
            raw = self.src.read(f"{p}/{DROPPED}" if p else DROPPED) or b""
            for line in raw.decode().splitlines():
                if line.strip().endswith("}"):
                    shard = json.loads(line)["shard"]
                    names.add(f"{p}/{shard}" if p else shard)
        return names

    def next_writer(self) -> str | None:
        """The partition ("" for the root) whose next shard the stream waits for; None when complete."""
        return None if self.parts is None or self.complete else self.parts[self._pi]

    def held(self, part: str) -> list[int]:
        """Bytes of each committed shard of `part` read so far that --retain-gb has not dropped."""
        gone = self.dropped([part])
        return [r["bytes"] for r in self._records.get(part, []) if r["shard"] not in gone]

    def record(self, q: int) -> dict:
        p, k = self.order[q]
        return self._records[p][k]

    def __len__(self) -> int:
        return len(self.order)

    def waiting_for(self) -> str:
        """What the next position is: the shard a reader waits for."""
        if self.meta is None:
            return f"{RUN_META} (the extraction has not started)"
        if self.parts is None:
            return "the first committed shard"
        p = self.parts[self._pi]
        return f"shard #{self._k} of {p or 'the output'} (stream position {len(self.order)})"
