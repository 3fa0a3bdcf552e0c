"""Samples of a vx output read by index, for trainers that ask for one sample at a time (SpecForge's
feature store, ModelOpt's offline dataset): the output's manifests say where each sample is, and its
rows are views of the mapped shard (coded blocks decoded, fp8 dequantized: those are new tensors).

A local shard is checked against its manifest's checksum the first time a sample of it is read; an
S3 shard is fetched whole into the bounded, checked cache vx.loader uses (vx/train/shard_cache.py)
and read from there. Reads may come from many threads at once and from DataLoader workers (a
reader is pickled without its maps and reopens them).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from vx.store.encoding import decode
from vx.store.format import RUN_META
from vx.store.reader import ShardFile
from vx.train.epoch_plan import Catalog

OPEN_MAPS = 16  # shards kept mapped


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
        # a forked DataLoader worker starts over: a cache's fetch threads do not survive a fork
        self._lock, self._shards, self._maps, self._pid = threading.Lock(), None, OrderedDict(), os.getpid()

    def __len__(self) -> int:
        return self.cat.num_samples

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_lock", "_shards", "_maps", "_pid"):
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
        f, offsets = self.shard(s)
        a, b = int(offsets[row]), int(offsets[row + 1])
        if limit is not None:
            b = min(b, a + limit)
        scales = f.rows("hidden_scales", a, b) if "hidden_scales" in f.entries else None
        states = decode(f.rows("hidden_states", a, b), scales)  # [T, L, H]: a view of the mapped shard (bf16)
        if pos == list(range(pos[0], pos[0] + len(pos))):  # a run of stored layers: still a view
            picked = states[:, pos[0]:pos[0] + len(pos)]                              # [T, n, H]
        else:  # one copy (cat of slices: ~2x index_select's rate here)
            picked = torch.cat([states[:, k:k + 1] for k in pos], 1)                 # [T, n, H]
        return f.rows("input_ids", a, b), f.rows("loss_mask", a, b), picked

    def shard(self, s: int) -> tuple[ShardFile, list[int]]:
        """Shard s mapped, with its sample offsets; checked (local) or fetched and checked (S3) once.
        A shard that fails raises ShardCorrupt (a VxError). Views of a map outlive its eviction."""
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            if s in self._maps:
                self._maps.move_to_end(s)
                return self._maps[s]
            shards = self._shards or self._open_shards()
            shards.get(s)
            f = ShardFile(shards.path(s))
            self._maps[s] = f, f.tensor("offsets").tolist()
            while len(self._maps) > OPEN_MAPS:
                self._maps.popitem(last=False)
            return self._maps[s]

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
