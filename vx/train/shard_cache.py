"""Shards for the loader: mapped in place from a local output, or, from S3, fetched into a bounded
local cache ahead of use.

S3: whole shards are downloaded by awscrt's S3 client (concurrent ranged GETs in its C threads,
off the trainer's GIL; boto3's transfer manager with VX_S3_CLIENT=boto3), several
shards at once, in the order the rank's plan will need them, at most `prefetch` shards ahead;
each is checked against the manifest's checksum (vx/store/checksum.py) on arrival (a corrupt or replaced object is
refused, never read) and published by an atomic rename. The cache holds at most `cache_gb`:
before a fetch, least recently used shards that no upcoming batch needs next are deleted; a
fetch waits when the rest of the cache is needed (so the bound is cache_gb plus the one shard in
flight, as long as cache_gb holds the shards of one batch).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vx.errors import VxError
from vx.store import checksum
from vx.store.checksum import ALGO
from vx.store.reader import ShardHeader

OPEN_FILES = 8  # mapped shards kept open per reader
FETCH_PART = 64 << 20  # the CRT client's ranged GETs


class ShardCorrupt(VxError):
    """A shard whose bytes do not match its manifest's checksum: never read."""


class LocalShards:
    check_on_open = True  # a shard's checksum is checked the first time a pass opens it

    def begin(self, k: int) -> None:
        pass

    def __init__(self, root: Path, records: list[dict]):
        self.root, self.records = root, records
        self._open: OrderedDict[int, ShardHeader] = OrderedDict()
        self._checked: set[int] = set()  # shards whose bytes matched their checksum in this pass

    def path(self, i: int) -> Path:
        return self.root / self.records[i]["shard"]

    def get(self, i: int) -> ShardHeader:
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        if self.check_on_open and i not in self._checked:  # CRC64-NVME: ~27 GB/s, and it warms the page cache
            rec = self.records[i]
            if (ALGO in rec or "sha256" in rec) and not checksum.file_ok(self.path(i), rec):
                raise ShardCorrupt(f"{self.path(i)}: {checksum.which(rec)} does not match the manifest (a "
                                   "corrupt shard); vx verify lists every bad one")
            self._checked.add(i)
        self._open[i] = ShardHeader(self.path(i))
        while len(self._open) > OPEN_FILES:
            self._open.popitem(last=False)[1].close()
        return self._open[i]

    def close(self) -> None:
        for h in self._open.values():
            h.close()
        self._open.clear()


class S3Shards(LocalShards):
    """The S3 cache of one reader (a rank, or one DataLoader worker of it). `plan` lists the
    shards of each batch this reader will assemble, in order; `begin(k)` says batch k is next."""

    check_on_open = False  # each shard is checked on arrival instead

    def __init__(self, url: str, endpoint_url: str | None, records: list[dict], cache_dir: Path, cache_bytes: int,
                 plan: list[list[int]], prefetch: int, concurrency: int):
        from boto3.s3.transfer import TransferConfig

        from vx.store.s3_client import make_client, parse_s3_url

        super().__init__(cache_dir, records)
        cache_dir.mkdir(parents=True, exist_ok=True)
        for stale in cache_dir.iterdir():  # this reader's own cache: what an earlier run left is not counted
            if stale.is_file():
                stale.unlink()
        self.target, self.client = parse_s3_url(url), make_client(endpoint_url)
        self.transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20,
                                       max_concurrency=concurrency)
        from vx.store import crt_s3

        # 64 MiB ranges: at 8 MiB the CRT's fetch ran at a quarter of the rate here (bench/upload.py)
        self.crt = crt_s3.CrtS3(self.client, FETCH_PART, concurrency) if crt_s3.wanted() else None
        self.cache_bytes, self.plan, self.prefetch = cache_bytes, plan, max(1, prefetch)
        self.peak_bytes = 0
        self._cond = threading.Condition()
        self._ready: set[int] = set()                        # in the cache, checked
        self._used: OrderedDict[int, None] = OrderedDict()   # LRU of ready shards
        self._pending: dict[int, object] = {}
        self._corrupt: dict[int, ShardCorrupt] = {}          # refused: get() raises for these alone
        self._k = 0                                          # the batch being assembled
        self._error: BaseException | None = None
        self._stop = False
        self._pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix="vx-shard-fetch")
        self._feeder = threading.Thread(target=self._feed, name="vx-shard-prefetch", daemon=True)
        self._feeder.start()

    def path(self, i: int) -> Path:
        return self.root / self.records[i]["shard"].replace("/", "__")

    def bytes_cached(self) -> int:
        return sum(self.records[i]["bytes"] for i in self._ready | set(self._pending))

    def begin(self, k: int) -> None:
        with self._cond:
            self._k = k
            self._cond.notify_all()

    def upcoming(self) -> list[int]:
        """Distinct shards from the current batch on: all of the current batch, then `prefetch` more."""
        out: dict[int, None] = dict.fromkeys(self.plan[self._k]) if self._k < len(self.plan) else {}
        base = len(out)
        for b in self.plan[self._k + 1:]:
            if len(out) >= base + self.prefetch:
                break
            out.update(dict.fromkeys(b))
        return list(out)

    def get(self, i: int):
        if i not in self._open:
            with self._cond:
                while i not in self._ready:
                    if self._error is not None:
                        raise self._error
                    if i in self._corrupt:
                        raise self._corrupt[i]
                    if i not in self._pending:
                        self._start(i, wait_for_room=False)
                    self._cond.wait(0.1)
                self._used[i] = None
                self._used.move_to_end(i)
        return super().get(i)

    def _start(self, i: int, wait_for_room: bool) -> bool:
        """Under the lock: make room for shard i and start its fetch; False if no room yet."""
        size, keep = self.records[i]["bytes"], set(self.upcoming()) | {i}
        for old in list(self._used):
            if self.bytes_cached() + size <= self.cache_bytes:
                break
            if old not in keep:
                self._evict(old)
        if wait_for_room and self.bytes_cached() + size > self.cache_bytes and (self._ready or self._pending):
            return False
        self._pending[i] = self._pool.submit(self._fetch, i)
        self.peak_bytes = max(self.peak_bytes, self.bytes_cached())
        return True

    def _evict(self, i: int) -> None:
        self._used.pop(i, None)
        self._ready.discard(i)
        h = self._open.pop(i, None)
        if h is not None:
            h.close()
        self.path(i).unlink(missing_ok=True)

    def _feed(self) -> None:
        """Start fetches for the shards the plan needs next, in order, at most `prefetch` at once."""
        try:
            with self._cond:
                while not self._stop and self._error is None:
                    ahead = [i for i in self.upcoming()
                             if i not in self._ready and i not in self._pending and i not in self._corrupt]
                    if not ahead or len(self._pending) >= self.prefetch or \
                            not self._start(ahead[0], wait_for_room=True):
                        self._cond.wait(0.05)
        except RuntimeError as e:
            # At interpreter exit concurrent.futures refuses new work before atexit closes this
            # cache (a pass left early): nothing more is needed, so the feeder just ends.
            if "shutdown" not in str(e):
                with self._cond:
                    self._error = VxError(f"shard prefetch failed: {e}")
                    self._cond.notify_all()

    def _fetch(self, i: int) -> None:
        rec = self.records[i]
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".fetch-")
            os.close(fd)
            if self.crt is not None:  # in the CRT's threads, off the trainer's GIL
                self.crt.get(self.target.bucket, self.target.key(rec["shard"]), Path(tmp))
            else:
                self.client.download_file(self.target.bucket, self.target.key(rec["shard"]), tmp, Config=self.transfer)
            if not checksum.file_ok(Path(tmp), rec):
                os.unlink(tmp)
                with self._cond:
                    self._pending.pop(i, None)
                    self._corrupt[i] = ShardCorrupt(
                        f"{self.target}/{rec['shard']}: {checksum.which(rec)} does not match the manifest (a corrupt or replaced "
                        "object); refusing to read it. Check the output with `vx verify`")
                    self._cond.notify_all()
                return
            os.replace(tmp, self.path(i))
            with self._cond:
                self._pending.pop(i, None)
                self._ready.add(i)
                self._used[i] = None
                self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._pending.pop(i, None)
                self._error = e if isinstance(e, VxError) else VxError(f"fetching {rec['shard']} failed: {e}")
                self._cond.notify_all()

    def close(self) -> None:
        if self._stop and not self._feeder.is_alive():
            return  # closed already (at exit, then by the pass's own cleanup)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._feeder.join()
        self._pool.shutdown(wait=True)
        super().close()


@contextlib.contextmanager
def open_shards(loader, tag: str, records: list[dict], plan: list[list[int]]):
    """The shard source for one pass of a Loader: `records` is its shard table (a follow pass
    appends to it), `plan` the shards of each batch this reader will assemble, in order (the S3
    cache fetches ahead along it; a follow pass appends to it too)."""
    if not loader.path.startswith("s3://"):
        src = LocalShards(Path(loader.path), records)
    else:
        base = Path(loader.cache_dir) if loader.cache_dir else Path(tempfile.gettempdir()) / "vx-loader-cache"
        key = hashlib.sha256(loader.path.encode()).hexdigest()[:12]
        src = S3Shards(loader.path, loader.endpoint_url, records, base / key / tag, loader.cache_bytes, plan,
                       loader.prefetch, loader.concurrency)
    loader.shards = src  # for inspection (peak_bytes) after or during a pass
    # A pass left before its end (a trainer stopping at its max steps) is closed at interpreter
    # exit while threads and modules still work; the generator's own cleanup then finds it closed.
    close, unregister = src.close, atexit.unregister
    atexit.register(close)
    try:
        yield src
    finally:
        close()
        unregister(close)
