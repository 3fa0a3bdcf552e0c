"""`vx.open_dataset(dir)`: read an extraction back, zero-copy, as a torch Dataset.

Only shards recorded in manifest.jsonl are visible. A partitioned run (data parallel, Ray,
--partition-index) keeps one shard sequence and manifest per partition under part-*/; they are
read as one dataset, each shard's path relative to the root. Tensors are views into a private
(copy-on-write) mmap of the shard file: nothing is read until it is touched. fp8 shards are
dequantized to bf16 on access (that one is a copy); coded shards (--compress blocks) decode the
blocks that hold a sample's rows on access.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from vx.errors import UsageError, VxError
from vx.store import blocks
from vx.store.encoding import decode
from vx.store.format import DROPPED, RUN_META, TORCH_DTYPE, output_dirs, read_manifest, row_bytes


class ShardFile:
    """One shard, mapped: `tensor(name)` returns a zero-copy view."""

    def __init__(self, path: Path):
        self.path = path
        if path.name.endswith(".zst"):  # compressed shard: decompressed into memory (no mmap)
            import zstandard

            with open(path, "rb") as f:
                self._mm = bytearray(zstandard.ZstdDecompressor().stream_reader(f).read())
        else:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        n = int.from_bytes(self._mm[:8], "little")
        header = json.loads(bytes(self._mm[8: 8 + n]))
        self.metadata = header.get("__metadata__", {})
        self.entries = blocks.entries(header)  # coded states (--compress blocks) under their own name
        self._base = 8 + n

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor: a view, or, coded, decoded into memory."""
        e = self.entries[name]
        return self.rows(name, 0, e["shape"][0]) if "coded" in e else tensor_at(self._mm, self._base, e)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a..b: a view, or, coded, only their blocks decoded."""
        e = self.entries[name]
        if "coded" not in e:
            return tensor_at(self._mm, self._base, e)[a:b]
        start = self._base + e["data_offsets"][0]
        return blocks.read_rows(e, a, b, lambda lo, hi: memoryview(self._mm)[start + lo:start + hi])


class ShardHeader:
    """A shard's tensor table and sample offsets, read once; rows are then read with pread straight
    into the caller's buffer (one copy from the page cache, no mapping faults); coded rows (--compress
    blocks) read their blocks' bytes at once and decode into it. Shards compressed whole (--compress
    zstd) are decompressed into memory instead."""

    def __init__(self, path: Path):
        self.path = path
        if path.name.endswith(".zst"):
            self.file, self.fd = ShardFile(path), None
            self.entries = self.file.entries
        else:
            self.file, self.fd = None, os.open(path, os.O_RDONLY)
            n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            self.entries, self._base = blocks.entries(json.loads(os.pread(self.fd, n, 8))), 8 + n
        self.offsets = self.rows("offsets", 0, len(self) + 1, None) if self.file is None else self.file.tensor("offsets")

    def __len__(self) -> int:
        return self.entries["offsets"]["shape"][0] - 1

    def rows(self, name: str, a: int, b: int, out):
        """Rows a..b of tensor `name` into `out` (a uint8-compatible tensor of the right size), or a new tensor."""
        e = self.entries[name]
        dtype, shape = TORCH_DTYPE[e["dtype"]], e["shape"]
        if self.file is not None:
            src = self.file.tensor(name)[a:b]
            if out is None:
                return src.clone()
            out.copy_(src)
            return out
        row = row_bytes(dtype, shape)
        if out is None:
            out = torch.empty([b - a, *shape[1:]], dtype=dtype)
        if self.fd is None:  # closed by the LRU while a batch still needed it
            self.fd = os.open(self.path, os.O_RDONLY)
        if "coded" in e:  # --compress blocks: the blocks that hold the rows, read at once and decoded
            at = self._base + e["data_offsets"][0]
            return blocks.read_rows(e, a, b, lambda lo, hi: self._pread(at + lo, hi - lo), out)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
        self._pread(self._base + e["data_offsets"][0] + a * row, len(view), view)
        return out

    def _pread(self, start: int, n: int, view: memoryview | None = None) -> memoryview:
        """n bytes at `start` into view (or a new buffer), however many reads it takes."""
        view = memoryview(bytearray(n)) if view is None else view
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], start + done)
            if got <= 0:
                raise VxError(f"{self.path}: shard shorter than its header says")
            done += got
        return view

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def coded_sizes(out_dir) -> tuple[int, int]:
    """(bytes the committed shards' coded states stand for, bytes they take) under an output."""
    raw = coded = 0
    for d in output_dirs(Path(out_dir)):
        for rec in read_manifest(d):
            h = ShardHeader(d / rec["shard"])
            for e in h.entries.values():
                if "coded" in e:
                    n = row_bytes(TORCH_DTYPE[e["dtype"]], e["shape"]) * e["shape"][0]
                    raw, coded = raw + n, coded + e["data_offsets"][1] - e["data_offsets"][0]
            h.close()
    return raw, coded


def tensor_at(buf, base: int, entry: dict) -> torch.Tensor:
    """The tensor a safetensors header entry describes, viewed in buf (its data starting at base)."""
    start, end = entry["data_offsets"]
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - start, offset=base + start) \
        if end > start else torch.empty(0, dtype=torch.uint8)
    return raw.view(TORCH_DTYPE[entry["dtype"]]).reshape(entry["shape"])


class VxDataset(Dataset):
    """An extracted dataset. `ds[i]` (int index) or `ds["id"]` (sample id) ->
    {"id", "input_ids" [T] int32, "loss_mask" [T] uint8, "hidden_states" [T, L, H]}."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UsageError(f"{self.path} is not a directory")
        meta_file = self.path / RUN_META
        self.meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        self.shards = []
        for d in output_dirs(self.path):
            rel = d.relative_to(self.path)
            self.shards += [dict(r, shard=str(rel / r["shard"])) for r in read_manifest(d)]
        self.ids: list[str] = []
        self._loc: list[tuple[int, int]] = []
        for s_idx, rec in enumerate(self.shards):
            for row, sid in enumerate(rec["sample_ids"]):
                self.ids.append(sid)
                self._loc.append((s_idx, row))
        self._index = {sid: i for i, sid in enumerate(self.ids)}
        self._open: dict[int, tuple[ShardFile, torch.Tensor]] = {}

    @property
    def layer_ids(self) -> list[int]:
        return self.meta.get("layer_ids", [])

    @property
    def num_tokens(self) -> int:
        return sum(r["num_tokens"] for r in self.shards)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._index

    def _shard(self, s_idx: int) -> tuple[ShardFile, torch.Tensor]:
        if s_idx not in self._open:
            path = self.path / self.shards[s_idx]["shard"]
            if not path.exists() and (path.parent / DROPPED).exists() and \
                    f'"{path.name}"' in (path.parent / DROPPED).read_text():
                raise UsageError(f"{self.shards[s_idx]['shard']} was deleted by vx extract --retain-gb once every "
                                 "follow reader had consumed it; its samples are no longer stored")
            f = ShardFile(path)
            self._open[s_idx] = (f, f.tensor("offsets"))
        return self._open[s_idx]

    def _rows_index(self, key: int | str) -> int:
        if isinstance(key, str):
            if key not in self._index:
                raise KeyError(f"no sample with id {key!r}")
            return self._index[key]
        return range(len(self))[key]

    def _rows(self, key: int | str):
        i = self._rows_index(key)
        s_idx, row = self._loc[i]
        shard, offsets = self._shard(s_idx)
        return i, shard, int(offsets[row]), int(offsets[row + 1])

    def shard_of(self, key: int | str) -> int:
        """The index in self.shards of the shard that holds a sample."""
        return self._loc[self._rows_index(key)][0]

    def tokens(self, key: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of one sample, without touching its states."""
        _, shard, a, b = self._rows(key)
        return shard.tensor("input_ids")[a:b], shard.tensor("loss_mask")[a:b]

    def __getitem__(self, key: int | str) -> dict:
        i, shard, a, b = self._rows(key)
        return {
            "id": self.ids[i],
            "input_ids": shard.tensor("input_ids")[a:b],
            "loss_mask": shard.tensor("loss_mask")[a:b],
            "hidden_states": decode(shard.rows("hidden_states", a, b),
                                    shard.rows("hidden_scales", a, b) if "hidden_scales" in shard.entries else None),
        }

    def __getstate__(self):  # picklable for DataLoader workers: maps are reopened lazily
        state = self.__dict__.copy()
        state["_open"] = {}
        return state


def open_dataset(path: str | Path) -> VxDataset:
    return VxDataset(path)
