"""Row blocks: a shard's hidden states coded losslessly block by block, so that a sample's rows
are still one byte range of the shard (`vx extract --compress blocks`).

The states [T, L, H] are cut into blocks of R = max(1, BLOCK // row bytes) rows (the last one
shorter), each coded on its own (vx/store/codec.py BlockCodec: byte planes for bf16/fp16,
zstd-1 for fp8). In the shard they replace the `hidden_states` tensor:
  hidden_states.blocks  U8 [coded bytes]  the coded blocks, one after the other
and the metadata key "coded" = JSON {"hidden_states": {"tensor": "hidden_states.blocks", "dtype",
"shape", "codec", "block_rows": R, "index": [B + 1 byte offsets into that tensor]}}. The header
alone thus locates every block: rows a..b are blocks a // R .. (b - 1) // R, one byte range to
read (an mmap slice, a pread, an S3 range GET) and decode.

Readers see a coded tensor as a header entry like any other (`entries(...)`: its dtype and shape
as stored before coding, plus "coded"); only the code that reads bytes asks `read_rows` for it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from vx.store.codec import BLOCK, BlockCodec
from vx.store.format import ST_DTYPE, TORCH_DTYPE, row_bytes

CODED = "coded"  # the shard metadata key
BLOCK_BYTES = BLOCK  # rows per block: as many as fit in this (tests make it small to cross blocks)


_CODECS: dict[int, BlockCodec] = {}


def _codec(itemsize: int) -> BlockCodec:
    if itemsize not in _CODECS:
        _CODECS[itemsize] = BlockCodec(itemsize)
    return _CODECS[itemsize]


def block_rows(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def code_rows(pieces: list[torch.Tensor], shape: list[int], pool: ThreadPoolExecutor | None) -> tuple[list, dict]:
    """Code the rows given in pieces ([t_i, L, H] each, contiguous CPU) -> (the buffers of
    hidden_states.blocks in order, its "coded" description). Blocks are coded on `pool`'s threads
    (the codec releases the GIL) or on this one."""
    dtype = pieces[0].dtype
    st_dtype = ST_DTYPE[dtype]
    row = row_bytes(dtype, shape)
    rows_per = block_rows(row)
    codec = _codec(dtype.itemsize)
    flat = [p.contiguous().view(torch.uint8).reshape(-1).numpy() for p in pieces if p.numel()]
    blocks, cur, room = [], [], rows_per * row
    for a in flat:  # cut the pieces at block boundaries (views, no copy)
        at = 0
        while at < len(a):
            take = min(room, len(a) - at)
            cur.append(a[at:at + take])
            at, room = at + take, room - take
            if room == 0:
                blocks.append(cur)
                cur, room = [], rows_per * row
    if cur:
        blocks.append(cur)
    coded = list(pool.map(codec.encode, blocks)) if pool is not None and len(blocks) > 1 else \
        [codec.encode(b) for b in blocks]
    index = [0]
    for bufs in coded:
        index.append(index[-1] + sum(memoryview(b).nbytes for b in bufs))
    info = {"tensor": "hidden_states.blocks", "dtype": st_dtype, "shape": list(shape), "codec": codec.name,
            "block_rows": rows_per, "index": index}
    return [b for bufs in coded for b in bufs], info


def entries(header: dict) -> dict:
    """A shard's safetensors header (its "__metadata__" removed or not) -> its tensor entries, a
    coded tensor shown under its own name: {"dtype", "shape", "data_offsets" (of the coded
    bytes), "coded": {codec, block_rows, index}}."""
    meta = header.get("__metadata__") or {}
    out = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in json.loads(meta.get(CODED, "{}")).items():
        blocks = out.pop(info["tensor"])
        out[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": blocks["data_offsets"],
                     "coded": {k: info[k] for k in ("codec", "block_rows", "index")}}
    return out


def read_rows(entry: dict, a: int, b: int, read, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows a..b of a coded entry into `out` (or a new tensor). read(lo, hi) -> the bytes lo..hi of
    the coded tensor (relative to its data start): called once, for the blocks that hold the rows."""
    dtype, shape, c = TORCH_DTYPE[entry["dtype"]], entry["shape"], entry["coded"]
    row = row_bytes(dtype, shape)
    if out is None:
        out = torch.empty([b - a, *shape[1:]], dtype=dtype)
    if b <= a:
        return out
    rows_per, index, total = c["block_rows"], c["index"], shape[0]
    if not 0 <= a < b <= total:
        raise IndexError(f"rows {a}:{b} of a tensor of {total}")
    k0, k1 = a // rows_per, (b - 1) // rows_per
    got = memoryview(read(index[k0], index[k1 + 1])).cast("B")
    codec = _codec(dtype.itemsize)
    dst = out.view(torch.uint8).reshape(-1).numpy()
    for k in range(k0, k1 + 1):
        r0, r1 = k * rows_per, min((k + 1) * rows_per, total)
        coded = got[index[k] - index[k0]: index[k + 1] - index[k0]]
        lo, hi = max(a, r0), min(b, r1)
        if (lo, hi) == (r0, r1):  # the whole block is wanted: decoded in place
            codec.decode(coded, dst[(r0 - a) * row:(r1 - a) * row])
        else:
            tmp = np.empty((r1 - r0) * row, np.uint8)
            codec.decode(coded, tmp)
            dst[(lo - a) * row:(hi - a) * row] = tmp[(lo - r0) * row:(hi - r0) * row]
    return out

