"""An extraction's output, and the one owner of its state.

An output lives in a local directory, mirrored to an S3 prefix when there is one. With
`-o s3://...` S3 is the truth and the local directory is only staging, under the vx cache and
keyed by endpoint, bucket and prefix. `Output` knows where it lives, its identity (vx.json),
its manifests and committed ids (local and remote, root and partitions), its lock and its
partitions; extract, the launchers, verify and the reader ask it.

Over 300 lines: the one owner of an output's state, local and in S3, root and partitions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from vx.errors import UsageError
from vx.store.format import (
    END,
    ERRORS,
    MANIFEST,
    RUN_FILES,
    RUN_META,
    output_dirs,
    part_dirs,
    read_manifest,
    repair_manifest,
    write_manifest,
)
from vx.store.lock import drop_dead_temps, hold, live_writer, write_atomically

# Keys of vx.json that must match for a rerun to continue the same output.
IDENTITY_KEYS = ("model_fingerprint", "layer_ids", "store_dtype", "hidden_size")
LOCK = ".vx-lock"

__all__ = ["Output", "ResumeState", "ErrorLog", "output_dirs", "part_dirs", "prepare_output", "output_lock",
           "staging_dir"]


def staging_dir(target, endpoint_url: str | None) -> Path:
    """The local staging of -o s3://bucket/prefix at this endpoint (the same bucket name at two
    endpoints is two outputs)."""
    from vx.home import cache_dir

    where = "aws" if not endpoint_url else endpoint_url.split("://", 1)[-1].rstrip("/")
    key = "".join(c if c.isalnum() or c in "-." else "_" for c in where)[:48]
    key += "-" + hashlib.sha256((endpoint_url or "").encode()).hexdigest()[:8]
    return cache_dir() / "staging" / key / target.bucket / (target.prefix or "_root")


@dataclass
class ResumeState:
    committed_ids: set[str]
    next_shard: int
    committed_tokens: int


class Output:
    def __init__(self, local: Path, target=None, endpoint_url: str | None = None, staged: bool = False):
        self.local, self.target, self.endpoint_url, self.staged = Path(local), target, endpoint_url, staged
        self.fence = None  # with S3, once this process writes here: its hold on the prefix (take())

    @classmethod
    def of(cls, cfg) -> "Output":
        target = None
        if cfg.upload:
            from vx.store.s3_client import parse_s3_url

            target = parse_s3_url(cfg.upload)
        return cls(cfg.output, target, cfg.endpoint_url, cfg.staged)

    def __str__(self) -> str:
        return str(self.target) if self.staged else str(self.local)

    def partition(self, name: str) -> "Output":
        target = None
        if self.target is not None:
            from vx.store.s3_client import S3Target

            target = S3Target(self.target.bucket, self.target.key(name))
        return Output(self.local / name, target, self.endpoint_url, self.staged)

    # -- what is committed ---------------------------------------------------------------------------
    def dirs(self) -> list[Path]:
        return output_dirs(self.local)

    def committed_elsewhere(self, exclude: "Output | None" = None) -> set[str]:
        """Ids committed in this output's directories (local and S3) other than `exclude`'s:
        partitions of this run or of an earlier one with another partition count."""
        skip = exclude.local.resolve() if exclude is not None else None
        ids: set[str] = set()
        for d in self.dirs():
            if d.resolve() != skip:
                ids.update(sid for r in read_manifest(d) for sid in r["sample_ids"])
        if self.target is not None:
            from vx.store.s3 import remote_committed_ids

            name = None if skip is None else "" if skip == self.local.resolve() else exclude.local.name
            ids |= remote_committed_ids(self.target, self.endpoint_url, exclude=name)
        return ids

    def first_error(self) -> dict:
        return next((json.loads(line) for d in self.dirs() if (d / ERRORS).exists()
                     for line in open(d / ERRORS) if line.strip()), {})

    # -- before a run --------------------------------------------------------------------------------
    def reset_or_sync(self, overwrite: bool) -> None:
        """--overwrite deletes the earlier extraction here (its S3 prefix and partitions too);
        otherwise the local state is brought in line with S3 (see sync_from_remote)."""
        if self.target is not None:
            from vx.store.s3 import clear_remote

            if overwrite:
                clear_remote(self.target, self.endpoint_url)
            else:
                self.sync_from_remote()
        if overwrite:
            for d in part_dirs(self.local):
                shutil.rmtree(d)
            from vx.store.format import PLAN_DIR, READERS

            shutil.rmtree(self.local / PLAN_DIR, ignore_errors=True)
            shutil.rmtree(self.local / READERS, ignore_errors=True)  # a new stream: earlier readers' records go

    def sync_from_remote(self) -> None:
        """A machine without local state fetches the S3 manifest and vx.json, to resume from them.
        Staging is S3's: when the prefix holds no extraction, stale staging is discarded (one
        line on stderr), and committed shards that are neither staged nor in S3 are redone."""
        from vx.store.s3 import (
            fetch_remote_state,
            remote_dropped,
            remote_has_extraction,
            remote_manifest,
        )

        if self.staged and self.local.exists() and not remote_has_extraction(self.target, self.endpoint_url):
            if any(self.local.iterdir()):
                print(f"vx: {self.target} holds no extraction; discarding the stale local staging at {self.local}",
                      file=sys.stderr)
                shutil.rmtree(self.local)
        if fetch_remote_state(self.target, self.endpoint_url, self.local) or not self.staged:
            return
        remote = {r["shard"] for r in remote_manifest(self.target, self.endpoint_url)}
        remote |= remote_dropped(self.target, self.endpoint_url)  # deleted once consumed: still committed
        records = read_manifest(self.local)
        keep = [r for r in records if r["shard"] in remote or (self.local / r["shard"]).exists()]
        if len(keep) < len(records):
            lost = sum(len(r["sample_ids"]) for r in records) - sum(len(r["sample_ids"]) for r in keep)
            print(f"vx: {len(records) - len(keep)} committed shards are neither staged nor in {self.target}; "
                  f"their {lost} samples will be redone", file=sys.stderr)
            write_manifest(self.local / MANIFEST, keep)

    def take(self) -> None:
        """With S3, in this output's lock: become the one writer of its prefix (vx/store/fence.py),
        and make the local manifest the one taken over, plus staged shards S3 does not hold yet
        whose samples it does not list (those are committed here, and go up next)."""
        if self.target is None:
            return
        from vx.store.s3_client import make_client
        from vx.store.fence import Fence
        from vx.store.s3 import remote_dropped

        self.fence = Fence.take(make_client(self.endpoint_url), self.target)
        remote = self.fence.records
        names = {r["shard"] for r in remote} | remote_dropped(self.target, self.endpoint_url)
        ids = {sid for r in remote for sid in r["sample_ids"]}
        records = read_manifest(self.local)
        keep = list(remote)
        for r in records:
            if r["shard"] in names:
                continue
            if (self.local / r["shard"]).exists() and not ids.intersection(r["sample_ids"]):
                keep.append(r)
            else:  # another writer's samples since, or a shard neither staged nor in S3: redone if not listed
                (self.local / r["shard"]).unlink(missing_ok=True)
        if keep != records and (keep or records):
            lost = len([r for r in records if r not in keep and r["shard"] not in names])
            if lost:
                print(f"vx: {lost} committed shards are neither staged nor in {self.target}; their samples will be "
                      "redone unless another writer committed them", file=sys.stderr)
            self.local.mkdir(parents=True, exist_ok=True)
            write_manifest(self.local / MANIFEST, keep)

    def prepare_root(self, meta: dict, overwrite: bool) -> None:
        """Launchers, once before their workers start: --overwrite, identity, root vx.json."""
        self.reset_or_sync(overwrite)
        with self.lock():
            prepare_output(self.local, meta, overwrite)
        self.publish_meta()

    def join(self, meta: dict) -> None:
        """A partition worker joins the root output: same model/layers/dtype, or refuse."""
        if self.target is not None:
            self.sync_from_remote()  # the root's vx.json from S3 (--overwrite is refused here)
        self.local.mkdir(parents=True, exist_ok=True)
        check_identity(self.local, meta)
        write_meta(self.local, meta)
        self.publish_meta(only_new=True)

    def publish_meta(self, only_new: bool = False) -> None:
        """vx.json to S3: through this writer's fence where it holds the prefix; only_new: only
        where there is none (a partition worker's root, which the launcher wrote)."""
        if self.target is None:
            return
        if self.fence is not None:
            self.fence.put(RUN_META, (self.local / RUN_META).read_bytes())
            return
        from vx.store.s3 import put_file, put_new

        if only_new:
            put_new(self.target, self.endpoint_url, self.local / RUN_META, RUN_META)
        else:
            put_file(self.target, self.endpoint_url, self.local / RUN_META, RUN_META)

    def lock(self):
        return output_lock(self.local)

    def open(self, meta: dict, overwrite: bool) -> ResumeState:
        return prepare_output(self.local, meta, overwrite)

    def begin_run(self) -> None:
        """A run starts writing here: the output is not complete any more (until end_run)."""
        (self.local / END).unlink(missing_ok=True)
        if self.target is not None:
            from vx.store.s3_client import make_client

            if self.fence is not None:
                self.fence.check()
            make_client(self.endpoint_url).delete_object(Bucket=self.target.bucket, Key=self.target.key(END))

    def ended(self) -> bool:
        """Whether a run of this output (or partition) marked its end, here or in S3."""
        from vx.store.s3 import remote_exists

        return (self.local / END).exists() or (self.target is not None and
                                               remote_exists(self.target, self.endpoint_url, END))

    def end_run(self) -> None:
        """Every row of this run is committed or rejected (and, with S3, uploaded): mark the end."""
        self.put_small(END, {"shards": len(read_manifest(self.local))})

    def put_small(self, name: str, record: dict) -> None:
        """A small JSON file of this output, written atomically here and put to S3."""
        self.local.mkdir(parents=True, exist_ok=True)
        write_atomically(self.local / name, json.dumps(record) + "\n")
        if self.fence is not None:
            self.fence.put(name, (self.local / name).read_bytes())
        elif self.target is not None:
            from vx.store.s3 import put_file

            put_file(self.target, self.endpoint_url, self.local / name, name)

    def uploader(self, keep_local: bool, max_local_bytes: int | None, before_publish=None):
        if self.target is None:
            return None
        from vx.store.uploader import Uploader

        return Uploader(self.local, self.target, self.endpoint_url, keep_local=keep_local,
                        max_local_bytes=max_local_bytes, before_publish=before_publish, fence=self.fence).start()


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
    drop_dead_temps(out)
    write_atomically(Path(out) / RUN_META, json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def output_lock(out: Path):
    """One writer per output directory (per partition directory): a second `vx extract` on the
    same one, on this machine or on another host sharing the filesystem (vx/store/lock.py hold),
    stops at once instead of deleting the first one's pending shards."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    held, holder = hold(out / LOCK)
    if holder:
        raise UsageError(f"{out} is being written by another vx extract ({holder}); wait for it or stop it first")
    try:
        yield
    finally:
        held.release()


def prepare_output(out: Path, meta: dict, overwrite: bool) -> ResumeState:
    """Create `out` or continue it. A different model/layers/dtype is refused unless overwrite.
    A directory some live process still writes into (an engine whose driver was killed) is
    refused before anything in it is touched."""
    out = Path(out)
    holder = live_writer(out) if out.exists() else None
    if holder:
        raise UsageError(f"{out} is still being written by {holder}; stop that process first")
    if overwrite and out.exists():
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        for f in out.glob("shard-*.safetensors*"):
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / RUN_META
    if meta_path.exists():
        check_identity(out, meta)
    elif any(out.glob("shard-*.safetensors*")) or read_manifest(out):
        raise UsageError(f"{out} holds shards but no {RUN_META}; refusing to mix runs (use --overwrite)")
    for tmp in out.glob(".shard-*.tmp"):
        tmp.unlink()
    repair_manifest(out / MANIFEST)
    records = read_manifest(out)
    committed = {sid for r in records for sid in r["sample_ids"]}
    listed = {r["shard"] for r in records}
    for f in out.glob("shard-*.safetensors*"):  # renamed but never committed: redo its samples
        if f.name not in listed:
            f.unlink()
    next_shard = 1 + max((int(r["shard"][6:11]) for r in records), default=-1)
    write_meta(out, meta)
    return ResumeState(committed, next_shard, sum(r["num_tokens"] for r in records))


class ErrorLog:
    """errors.jsonl: one record per bad dataset row, rewritten by each run (it is derived data)."""

    def __init__(self, out: Path):
        self.path = Path(out) / ERRORS
        self._f = open(self.path, "w")
        self.count = 0
        self._lock = threading.Lock()  # bad rows come from the reader, rejected states from the writer thread

    def write(self, record: dict) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            self.count += 1

    def close(self) -> None:
        self._f.close()
