"""Samples of a vx output read by index, for trainers that ask for one sample at a time (SpecForge's
feature store, ModelOpt's offline dataset): the output's manifests say where each sample is, and its
rows are read from the shard's bytes alone (pread, coded blocks decoded, fp8 dequantized).

A local shard is checked against its manifest's checksum the first time a sample of it is read; an
S3 shard is fetched whole into the bounded, checked cache vx.loader uses (vx/train/shard_cache.py)
and read from there. Reads may come from many threads at once (each keeps its own open headers)
and from DataLoader workers (a reader is pickled without its open files and reopens them).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from vx.store.encoding import decode
from vx.store.format import RUN_META
from vx.store.reader import ShardHeader
from vx.train.epoch_plan import Catalog

OPEN_HEADERS = 4  # shard headers each reading thread keeps open


def options_to_env(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` without the `--vx-NAME VALUE` options named by `env` ({name: variable}), each value
    set as its variable (ranks a trainer launches itself inherit it). Raises UsageError for a flag
    without its value."""
    from vx.errors import UsageError

    args = list(args)
    for name, var in env.items():
        flag = "--vx-" + name.replace("_", "-")
        while flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                raise UsageError(f"{flag} needs a value")
            os.environ[var] = args.pop(i + 1)
            args.pop(i)
    return args


def is_output(path) -> bool:
    """Whether `path` names a vx output (an s3:// URL is taken for one; its manifests then say)."""
    return str(path).startswith("s3://") or (Path(path) / RUN_META).is_file()


class OutputRows:
    """`read(i, layers, n)` -> (input_ids [T], loss_mask [T], states [T, len(layers), H]) of sample i
    (the output's order), its first n tokens at most."""

    def __init__(self, output: str, endpoint_url: str | None = None, cache_dir: str | None = None,
                 cache_gb: float = 20.0, tag: str = "rows"):
        remote = str(output).startswith("s3://")
        self.cat = Catalog(str(output) if remote else str(Path(output).resolve()), endpoint_url)
        self.stored = list(self.cat.meta.get("layer_ids", []))
        self.num_layers = int(self.cat.meta["num_layers"])
        self.cache_dir, self.cache_gb, self.tag = cache_dir, cache_gb, tag
        self._reset()

    def _reset(self) -> None:
        self._lock, self._local, self._shards = threading.Lock(), threading.local(), None

    def __len__(self) -> int:
        return self.cat.num_samples

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_lock", "_local", "_shards"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def read(self, index: int, layers: list[int], limit: int | None = None):
        missing = [k for k in layers if k not in self.stored]
        if missing:
            raise KeyError(f"layers {missing} are not in the output (it holds {self.stored})")
        pos = [self.stored.index(k) for k in layers]
        s, row = int(self.cat.shard_of[index]), int(self.cat.row[index])
        h = self._header(s)
        a, b = int(h.offsets[row]), int(h.offsets[row + 1])
        if limit is not None:
            b = min(b, a + limit)
        scales = h.rows("hidden_scales", a, b, None) if "hidden_scales" in h.entries else None
        states = decode(h.rows("hidden_states", a, b, None), scales)                  # [T, L, H]
        picked = states if pos == list(range(len(self.stored))) else states[:, pos]   # [T, n, H]
        return h.rows("input_ids", a, b, None), h.rows("loss_mask", a, b, None), picked

    def _header(self, s: int) -> ShardHeader:
        """This thread's open header of shard s; the shard is checked (local) or fetched and checked
        (S3) once for all threads. A shard that fails raises ShardCorrupt (a VxError)."""
        mine = getattr(self._local, "headers", None)
        if mine is None:
            mine = self._local.headers = OrderedDict()
        if s in mine:
            mine.move_to_end(s)
            return mine[s]
        with self._lock:
            shards = self._shards or self._open_shards()
            shards.get(s)
            path = shards.path(s)
        mine[s] = ShardHeader(path)
        while len(mine) > OPEN_HEADERS:
            mine.popitem(last=False)[1].close()
        return mine[s]

    def _open_shards(self):
        from vx.train.shard_cache import LocalShards, S3Shards

        if not self.cat.remote:
            self._shards = LocalShards(Path(self.cat.path), self.cat.shards)
        else:
            base = Path(self.cache_dir) if self.cache_dir else Path(tempfile.gettempdir()) / "vx-loader-cache"
            key = hashlib.sha256(self.cat.path.encode()).hexdigest()[:12]
            from torch.utils.data import get_worker_info

            info = get_worker_info()  # a DataLoader worker has a cache of its own (a share of cache_gb)
            workers, wid = (info.num_workers, info.id) if info else (1, 0)
            where = base / key / (f"{self.tag}-r{os.environ.get('RANK', '0')}" + (f"-w{wid}" if info else ""))
            self._shards = S3Shards(self.cat.path, self.cat.endpoint_url, self.cat.shards, where,
                                    int(self.cache_gb * 1e9 / workers), plan=[], prefetch=1, concurrency=8)
        return self._shards
