"""`vx.loader(path, tokens_per_batch=...)`: packed, shuffled, distributed, resumable batches from a
vx output (a local directory or s3://bucket/prefix), for training a drafter.

The epoch plan comes from the manifests alone (every sample's id, shard and length), the same in
every process for the same (seed, epoch): shards in a seeded order, samples shuffled within a
window of `shuffle_shards` consecutive shards (the bounded buffer), packed in that order into
batches of at most `tokens_per_batch` tokens (a longer sample is a batch of its own), batches
dealt round robin to ranks. The batch count is made a multiple of world_size by splitting
multi-sample batches, so every rank runs the same number of steps (an uneven tail hangs DDP/FSDP
collectives) and every sample is read exactly once per epoch. Under a DataLoader, worker w of W
takes batches position + w, position + w + W, ... of its rank, which the DataLoader yields back
in order. `state_dict()` is {"epoch", "position", ...}; after `load_state_dict` the batches
before position are skipped without reading anything.

`follow=True` reads the first epoch while `vx extract` writes it, window by window, and
`commit(state)` tells `vx extract --retain-gb` what this rank has consumed (vx/train/follow.py).
The catalog and the plan live in vx/train/epoch_plan.py; S3 outputs are read through a bounded local
cache (vx/train/shard_cache.py).
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vx.store.encoding import decode
from vx.train.epoch_plan import Batch, Catalog, plan_epoch


class Loader(IterableDataset):
    """Packed batches of one rank; see the module docstring. Iterate it directly, or hand it to
    `torch.utils.data.DataLoader(loader, batch_size=None, num_workers=N)`."""

    def __init__(self, path, tokens_per_batch: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 epoch: int = 0, shuffle: bool = True, shuffle_shards: int = 8, flatten_layers: bool = False,
                 device: str | torch.device | None = None, cache_dir: str | None = None, cache_gb: float = 20.0,
                 prefetch: int = 4, concurrency: int = 8, endpoint_url: str | None = None, follow: bool = False,
                 follow_timeout: float = 1800.0):
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if cache_gb <= 0 or shuffle_shards < 1:
            raise ValueError("cache_gb must be > 0 and shuffle_shards >= 1")
        if follow_timeout <= 0:
            raise ValueError(f"follow_timeout must be > 0 s, got {follow_timeout}")
        self.path, self.tokens_per_batch, self.rank, self.world_size = str(path), tokens_per_batch, rank, world_size
        self.seed, self.epoch, self.position, self.shuffle, self.shuffle_shards = seed, epoch, 0, shuffle, shuffle_shards
        self.flatten_layers, self.device = flatten_layers, torch.device(device) if device is not None else None
        self.cache_dir, self.cache_bytes, self.prefetch, self.concurrency = cache_dir, int(cache_gb * 1e9), prefetch, concurrency
        self.endpoint_url, self.follow, self.follow_timeout = endpoint_url, follow, follow_timeout
        # follow: the first epoch is read window by window while the output grows (vx/train/follow.py);
        # later epochs read it as a finished output, so the catalog is made when one starts
        self.catalog = None if follow else Catalog(self.path, endpoint_url)
        self._follow = None
        self._plan_key, self._plan = None, None
        self._pool = BufferPool()

    @property
    def meta(self) -> dict:
        if self.catalog is None:
            return self._following().meta_now()
        return self.catalog.meta

    def _following(self):
        if self._follow is None:
            from vx.train.follow import Follow

            self._follow = Follow(self)
        return self._follow

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def batches(self) -> list[Batch]:
        """This rank's plan for the current epoch (metadata only); in follow mode the first epoch's
        is known once the extraction is complete (it waits)."""
        if self.follow and self.epoch == 0:
            return self._following().all_batches()
        if self.catalog is None:
            self.catalog = self._following().finished_catalog()
        key = (self.seed, self.epoch)
        if self._plan_key != key:
            self._plan = plan_epoch(self.catalog, self.tokens_per_batch, self.world_size, self.seed,
                                    self.epoch, self.shuffle, self.shuffle_shards)[self.rank]
            self._plan_key = key
        return self._plan

    def __len__(self) -> int:
        if self.follow and self.epoch == 0 and not self._following().complete():
            raise TypeError("a follow loader's first epoch has no length until the extraction completes")
        return len(self.batches())

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "rank": self.rank,
                "world_size": self.world_size, "tokens_per_batch": self.tokens_per_batch,
                "num_samples": self.catalog.num_samples if self.catalog is not None else None,
                "follow": self.follow, "shuffle_shards": self.shuffle_shards}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "world_size", "tokens_per_batch") + (("shuffle_shards",) if self.follow else ()):
            if state.get(k, getattr(self, k)) != getattr(self, k):
                raise ValueError(f"state has {k}={state[k]}, this loader {getattr(self, k)}: not the same plan")
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self):
        from vx.train.shard_cache import open_shards

        if self.follow and self.epoch == 0:
            yield from self._following().iterate()
            return
        plan = self.batches()
        info = get_worker_info()
        step = info.num_workers if info else 1
        mine = list(range(self.position + (info.id if info else 0), len(plan), step))
        wid = info.id if info else 0
        cat = self.catalog
        shard_plan = [list(dict.fromkeys(cat.shard_of[plan[j].samples].tolist())) for j in mine]
        with open_shards(self, f"r{self.rank}-w{wid}", cat.shards, shard_plan) as shards:
            for k, j in enumerate(mine):
                shards.begin(k)
                batch = self._assemble(cat, plan[j], shards)
                if info is None:
                    self.position = j + 1
                yield batch

    def __getstate__(self):  # DataLoader workers: a follow reader and a pass's shard source are per process
        state = self.__dict__.copy()
        state["_follow"] = None
        state.pop("shards", None)
        return state

    def commit(self, state: dict | None = None) -> None:
        """Record, beside the output, that this rank consumed every batch before `state` (the
        state_dict() saved in your checkpoint; default: now). `vx extract --retain-gb` deletes a
        shard once every rank has committed past it, so commit after the checkpoint is durable."""
        if not self.follow:
            raise ValueError("commit() records what a follow reader consumed (for vx extract --retain-gb): "
                             "make the loader with follow=True")
        self._following().commit(state or self.state_dict())

    def _assemble(self, cat, batch: Batch, shards) -> dict:
        idx = batch.samples
        heads = [shards.get(int(s)) for s in cat.shard_of[idx]]
        rows = cat.row[idx].tolist()
        lengths = torch.from_numpy(cat.tokens[idx].astype("int32"))
        cu = torch.zeros(len(idx) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        total = int(cu[-1])
        pin = self.device is not None and self.device.type == "cuda"
        spec = heads[0].entries if heads else {}
        fp8 = "hidden_scales" in spec

        from vx.store.format import TORCH_DTYPE

        names = ("input_ids", "loss_mask", "hidden_states") + (("hidden_scales",) if fp8 else ())
        shapes = {n: ([total, *spec[n]["shape"][1:]], TORCH_DTYPE[spec[n]["dtype"]]) for n in names}
        if pin:  # CUDA's pinned host allocator caches its blocks
            out = {n: torch.empty(shape, dtype=dt, pin_memory=True) for n, (shape, dt) in shapes.items()}
        else:
            out = self._pool.tensors(shapes, self.tokens_per_batch)
        for k, (row, h) in enumerate(zip(rows, heads)):
            a, b, lo, hi = int(h.offsets[row]), int(h.offsets[row + 1]), int(cu[k]), int(cu[k + 1])
            for name, t in out.items():
                h.rows(name, a, b, t[lo:hi])
        hidden, hscale = out.pop("hidden_states"), out.pop("hidden_scales", None)  # [T, L, H] in the store dtype
        result = {"input_ids": out["input_ids"].long(), "loss_mask": out["loss_mask"],
                  "position_ids": torch.cat([torch.arange(int(t)) for t in lengths]), "cu_seqlens": cu,
                  "max_seqlen": int(lengths.max()), "sample_ids": [cat.id(int(i)) for i in idx],
                  "padding": batch.padding}
        if batch.padding:
            result["loss_mask"] = torch.zeros_like(result["loss_mask"])
        if self.device is not None:
            result = {k: v.to(self.device, non_blocking=pin) if isinstance(v, torch.Tensor) else v
                      for k, v in result.items()}
            hidden = hidden.to(self.device, non_blocking=pin)
            hscale = hscale.to(self.device, non_blocking=pin) if hscale is not None else None
        hidden = decode(hidden, hscale)  # fp8 dequantized where it now lives (the target device)
        result["hidden_states"] = hidden.flatten(1) if self.flatten_layers else hidden
        return result


class BufferPool:
    """Host memory for batches, reused once no batch refers to it: a fresh allocation per batch
    costs a page fault per 4 KB (it halved the loader's GB/s). Each buffer is a bytearray that
    every tensor made from it keeps alive, so its reference count says whether it is still in use."""

    def __init__(self, keep: int = 4):
        self.keep, self.buffers = keep, []

    def tensors(self, shapes: dict, budget_rows: int) -> dict:
        """Tensors of `shapes` ([rows, ...] each) carved from one pooled buffer; buffers are made
        for at least `budget_rows` rows, so any batch within the budget fits any of them."""
        sizes = {n: _aligned(_nbytes(shape, dt)) for n, (shape, dt) in shapes.items()}
        full = sum(_aligned(_nbytes([max(shape[0], budget_rows), *shape[1:]], dt)) for shape, dt in shapes.values())
        need = max(1, sum(sizes.values()))
        buf = next((b for b in self.buffers if len(b) >= need and sys.getrefcount(b) <= 3), None)
        if buf is None:
            buf = bytearray(max(need, full))
            if len(self.buffers) < self.keep:
                self.buffers.append(buf)
            else:  # every pooled buffer is still held by a batch: replace the smallest free one, or none
                free = [i for i, b in enumerate(self.buffers) if sys.getrefcount(b) <= 3]
                if free:
                    self.buffers[min(free, key=lambda i: len(self.buffers[i]))] = buf
        out, at = {}, 0
        for n, (shape, dt) in shapes.items():
            count = _nbytes(shape, dt)
            out[n] = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=at).view(dt).view(shape) \
                if count else torch.empty(shape, dtype=dt)
            at += sizes[n]
        return out


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def loader(path, tokens_per_batch: int, **kwargs) -> Loader:
    return Loader(path, tokens_per_batch, **kwargs)
