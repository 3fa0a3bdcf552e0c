"""The regenerated conversations of `vx extract --regenerate -o s3://...`, kept in S3 with their states.

S3 is the truth of an output there; the local directory is only staging (vx/store/output.py). A
rerun on another machine must find the text of every conversation whose states S3 holds: without
it, the regeneration would write new text for conversations whose old states the capture skips.

- sync(), before each S3 manifest that publishes new shards (vx/store/uploader.py): the followed
  file's committed bytes not yet in S3 go up as one segment,
  PREFIX/regenerated.jsonl.d/<time_ns>-<part>-<nonce>.jsonl. Every published state is then of
  text already in S3.
- restore(), before the regeneration starts: the segments in key order, a later line of a
  conversation replacing an earlier one (a conversation is regenerated only while none of its
  states is committed, so the latest text of a committed conversation is its states'). For every
  conversation with states in S3, the local text becomes S3's; then the result goes up as one
  segment and the older segments are deleted (a crash between the two leaves both: the later wins).
- finish(), once every partition is done: the whole file as one segment (the older ones deleted),
  and a copy as PREFIX/regenerated.jsonl, what users read; merge_from_s3() first where the
  partitions ran on other nodes (--ray, --partition-index: merge_when_complete).
- put_errors(), once a partition's regeneration has ended: its bad records (every run reports all
  of its partition's) as PREFIX/regenerated.jsonl.errors.d/<part>.jsonl, replacing its earlier
  run's; merge_from_s3() gathers them into PREFIX/regenerated.jsonl.errors.jsonl, as a single
  run's are.

Segments sort by the writer's clock: runs of one output follow each other (a rerun starts after a
crash), not at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

from vx import faults
from vx.data.follow import committed_bytes
from vx.errors import UsageError
from vx.store.format import GENERATION, REGENERATED, TEXT_ERRORS, TEXT_SEGMENTS
from vx.store.lock import write_atomically
from vx.store.text_output import mark_committed, truncate_torn


def _id(line: bytes) -> str:
    return str(json.loads(line)["id"])


def _lines(data: bytes) -> list[bytes]:
    return [raw + b"\n" for raw in data.split(b"\n") if raw.strip()]


class RegeneratedText:
    """The regenerated text of one S3 output (target: its root prefix), followed at `path` (the
    root's regenerated.jsonl, or a partition's part) by this process."""

    def __init__(self, target, endpoint_url: str | None, path: Path, part: str = "all",
                 generation: Path | None = None):
        from vx.store.s3_client import make_client

        self.target, self.path, self.part = target, Path(path), part
        self.generation = generation  # the root's regenerate.json: put to S3 with the first segment
        self.client = make_client(endpoint_url)
        self.endpoint_url = endpoint_url
        self.offset = 0  # bytes of path already in S3
        self._nonce = uuid.uuid4().hex[:8]

    # -- segments ----------------------------------------------------------------------------------
    def _keys(self, folder: str) -> list[str]:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.target.bucket, Prefix=self.target.key(folder + "/")):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return sorted(keys)

    def _segments(self) -> list[str]:
        return self._keys(TEXT_SEGMENTS)

    def _put_segment(self, body: bytes) -> str:
        if self.generation is not None and self.generation.exists():  # how the text was generated, first
            from vx.store.s3 import put_file

            put_file(self.target, self.endpoint_url, self.generation, GENERATION)
            self.generation = None
        key = self.target.key(f"{TEXT_SEGMENTS}/{time.time_ns():020d}-{self.part}-{self._nonce}.jsonl")
        faults.point("before-text-segment")
        self.client.put_object(Bucket=self.target.bucket, Key=key, Body=body)
        return key

    def _compact(self, body: bytes) -> None:
        """body as one segment, then every older segment deleted."""
        older = self._segments()
        self._put_segment(body)
        faults.point("after-text-compact")
        for i in range(0, len(older), 1000):
            self.client.delete_objects(Bucket=self.target.bucket,
                                       Delete={"Objects": [{"Key": k} for k in older[i:i + 1000]]})

    def sync(self) -> None:
        """The committed bytes of path not yet in S3, as one segment (the uploader's before_publish)."""
        end = committed_bytes(self.path)
        if end <= self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            body = f.read(end - self.offset)
        self._put_segment(body)
        self.offset = end

    # -- before a run ------------------------------------------------------------------------------
    def restore(self, into: Path, parts: tuple[Path, ...] = (), compact: bool = True) -> int:
        """Make the local text S3's for every conversation whose states S3 holds: appended to `into`
        (the root's regenerated.jsonl, what a regeneration counts as done) where `into` lacks it,
        conflicting lines dropped from `into` and `parts`; returns how many were added. compact: then the result as
        one segment and the older ones deleted (only where no other writer of this output runs:
        its segments would go). Raises when S3 holds states of a conversation without its text."""
        from vx.errors import VxError
        from vx.store.s3 import remote_committed_ids

        # the committed ids first: a state is published only after its text, so every segment a
        # committed conversation's text is in is listed by the time the segments are
        committed = remote_committed_ids(self.target, self.endpoint_url, exclude=None)
        text = self._latest()
        missing = committed - text.keys()
        if missing:
            raise VxError(f"{self.target} holds the states of {len(missing)} conversations but not their regenerated "
                          f"text (first {sorted(missing)[0]!r}); rerun with --overwrite to start over")
        if not committed and (not compact or not text):  # nothing to take (a first run: nothing in S3)
            return 0
        want = {i: text[i] for i in committed}
        with _locked(into):  # partition workers of one node restore into the same file
            for p in parts:  # a part's conflicting lines go; its others are merged later (each id once)
                if p != into:
                    _keep_only(p, want)
            have = _keep_only(into, want)  # into holds every committed conversation's text after this: the
            added = [want[i] for i in sorted(want.keys() - have)]  # compaction's one segment is into
            if added:
                _append(into, b"".join(added))
                print(f"vx: {len(added)} regenerated conversations with states in {self.target} restored from it",
                      file=sys.stderr)
            if compact:
                body = into.read_bytes() if into.exists() else b""
                self._compact(body)
                if into == self.path:
                    self.offset = len(body)
        return len(added)

    def _latest(self) -> dict[str, bytes]:
        """Every conversation's latest line over the segments (later segments replace earlier lines)."""
        text: dict[str, bytes] = {}
        for key in self._segments():
            for line in _lines(self.client.get_object(Bucket=self.target.bucket, Key=key)["Body"].read()):
                text[_id(line)] = line
        return text

    # -- after the run -----------------------------------------------------------------------------
    def _errors_path(self) -> Path:
        return self.path.with_name(self.path.name + ".errors.jsonl")

    def put_errors(self) -> None:
        """This partition's bad records (path's errors file) into S3, for merge_from_s3."""
        from vx.store.s3 import put_file

        errors = self._errors_path()
        if errors.exists():
            put_file(self.target, self.endpoint_url, errors, f"{TEXT_ERRORS}/{self.part}.jsonl")

    def merge_from_s3(self) -> int:
        """path := every conversation's latest text in S3 (the partitions ran on other nodes), and
        its errors file every partition's bad records; then finish(); returns the conversations."""
        text = self._latest()
        errors = b"".join(self.client.get_object(Bucket=self.target.bucket, Key=key)["Body"].read()
                          for key in self._keys(TEXT_ERRORS))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, b"".join(text.values()), durable=True)
        write_atomically(self._errors_path(), errors, durable=True)
        mark_committed(self.path)
        self.finish()
        return len(text)

    def finish(self) -> None:
        """The whole file as one segment, and PREFIX/regenerated.jsonl (with its errors) for users."""
        from vx.store.s3 import put_file

        body = self.path.read_bytes()
        self._compact(body)
        self.offset = len(body)
        put_file(self.target, self.endpoint_url, self.path, REGENERATED)
        errors = self._errors_path()
        if errors.exists():
            put_file(self.target, self.endpoint_url, errors, errors.name)


@contextlib.contextmanager
def _locked(path: Path):
    """path's writer lock (OUTPUT.lock, vx/store/text_output.py), waited for."""
    from vx.store.text_output import take_lock

    lock = take_lock(path, "vx process")
    try:
        yield
    finally:
        lock.close()


def text_in_s3(cfg, path: Path, part: str = "all") -> RegeneratedText | None:
    """With -o s3://: the keeper in S3 of the text at path (a one-pass config's), else None."""
    if not cfg.upload:
        return None
    from vx.store.s3_client import parse_s3_url

    return RegeneratedText(parse_s3_url(cfg.upload), cfg.endpoint_url, path, part, Path(cfg.output) / GENERATION)


def merge_when_complete(cfg) -> dict:
    """A --partition-index run: once every partition's capture has ended (its end mark, here or in
    S3), OUT/regenerated.jsonl from the parts (local) or from S3's text (each partition's node
    kept its own part). Returns where the text is, and whether this run merged it."""
    from vx.store.format import part_name
    from vx.store.output import Output

    root = Output.of(cfg)
    out = Path(cfg.output) / REGENERATED
    if not all(root.partition(part_name(i, cfg.num_partitions)).ended() for i in range(cfg.num_partitions)):
        return {"merged": False, "output": f"{cfg.upload.rstrip('/')}/{REGENERATED}" if cfg.upload else str(out)}
    if cfg.upload:
        n = text_in_s3(cfg, out).merge_from_s3()
        return {"merged": True, "output": f"{cfg.upload.rstrip('/')}/{REGENERATED}", "conversations_in_output": n}
    from vx.store.text_output import merge_parts

    try:
        merged = merge_parts(out, cfg.num_partitions)
    except UsageError:  # another partition merges now
        return {"merged": False}
    return {"merged": merged["complete"], "output": str(out), "conversations_in_output": merged["conversations"]}


def _keep_only(path: Path, want: dict[str, bytes]) -> set[str]:
    """Drop the lines of path that S3 holds another text of (rewritten atomically, only when one
    differs); returns the ids of path's lines that agree with S3."""
    if not path.exists():
        return set()
    truncate_torn(path)
    lines = _lines(path.read_bytes())
    keep = [line for line in lines if (i := _id(line)) not in want or want[i] == line]
    if len(keep) < len(lines):
        print(f"vx: {len(lines) - len(keep)} regenerated conversations in {path} differ from the text of their "
              "states in S3; S3's kept", file=sys.stderr)
        write_atomically(path, b"".join(keep), durable=True)
        mark_committed(path)
    return {i for line in keep if (i := _id(line)) in want}


def _append(path: Path, body: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    mark_committed(path)
