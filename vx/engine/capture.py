"""The capture hot path on the worker, device side: completed requests' cached rows -> checked,
encoded chunks, and the sizes the driver gives the worker (capture_budget).

In the step that computes the last of their kept rows, the CaptureSink (vx/engine/sink.py) gets
those requests, as one list of cache slots: a group of rows. Chunk by chunk of at most
`chunk_rows` rows, on the compute stream right after the step's forward (so the blocks may be
reused by the next one, and vLLM frees them at once):
  a gather of the chunk's rows      [t, L, H]   (vLLM's cache-only KV group)
  the checks' token flags           [t], [t, L]
  the store-dtype encoding          fp8 halves what crosses PCIe
then, on a GPU, one async copy into a slot of a pinned ring on a side stream, and an event.
So the device memory the capture takes outside vLLM's budget is bounded by the chunk and the
copies in flight (COPY_BYTES), not by the requests' lengths (one 60k-token sample of a 27B target
would need ~15 GB at once). Every step is row-local: shards are bit-identical whatever the chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vx import faults
from vx.engine.pinned_ring import ALIGN
from vx.store.encoding import STORE_DTYPES, prepare

RING_STEPS = 3  # the pinned ring holds this many full engine steps of encoded rows
DEVICE_BYTES = 256 << 20  # device memory one chunk's gather and encoding may take (outside vLLM's budget)


def store_row_bytes(layers: int, hidden: int, store_dtype: str) -> int:
    """Host bytes one encoded row takes in a ring slot: states, flags, fp8 scales."""
    size = torch.empty(0, dtype=STORE_DTYPES[store_dtype]).element_size()
    return layers * hidden * size + 1 + layers + (4 * layers if store_dtype == "fp8" else 0)


def device_row_bytes(layers: int, hidden: int, store_dtype: str, cache_dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak device bytes per row while a chunk is gathered and encoded (the bound the chunk size
    is chosen from): the gathered rows, the encoding's temporaries and output, the flags."""
    n = layers * hidden
    cache = torch.empty(0, dtype=cache_dtype).element_size()
    store = torch.empty(0, dtype=STORE_DTYPES[store_dtype]).element_size()
    if store_dtype == "fp8":
        encode = 4 * n + store * n  # one fp32 copy, divided in place, then the fp8 output
    else:
        encode = 0 if STORE_DTYPES[store_dtype] == cache_dtype else store * n
    small = 32 + 16 * layers  # slot arithmetic, min/max, amax and scales per layer, the flags
    return cache * n + encode + small


def capture_budget(step_tokens: int, layers: int, hidden: int, store_dtype: str,
                   cache_dtype: torch.dtype = torch.bfloat16, device_bytes: int = DEVICE_BYTES,
                   shard_bytes: int = 0) -> dict:
    """What the driver gives the worker: rows per chunk (a full step at most, and within
    device_bytes), the pinned ring's size and, of it, the bytes the shard writer may hold.

    The ring takes RING_STEPS full steps of encoded rows for the copies in flight, and the rest
    for the writer: it writes shards straight from the ring (no host copy), holding a slot until
    its shard is committed, up to hold_bytes; past that it copies rows out. torch rounds a pinned
    allocation up to a power of two, so the ring is that size (capped at RING_CAP for the writer's
    share, which a shard's worth fills: 4 GiB for a 27B target's 8k-token steps and 1 GB shards)."""
    chunk_rows = max(1, min(step_tokens, device_bytes // device_row_bytes(layers, hidden, store_dtype, cache_dtype)))
    slot_slack = 4 * ALIGN  # each region of a slot is rounded up to ALIGN
    steps = -(-step_tokens // chunk_rows)  # chunks per full step
    in_flight = RING_STEPS * (step_tokens * store_row_bytes(layers, hidden, store_dtype) + steps * slot_slack)
    want = in_flight + int(shard_bytes * 1.05)  # a full shard's slots, flags and padding included
    ring = max(in_flight, min(_pow2(want), max(RING_CAP, _pow2(in_flight))))
    return {"chunk_rows": int(chunk_rows), "ring_bytes": int(ring), "hold_bytes": int(ring - in_flight)}


EXECUTE_TIMEOUT_S = 300.0  # vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS default (0.32, 0.33)


def execute_wait_bound_s(environ=None) -> float:
    """The longest the forward may wait for ring space inside a step: half of vLLM's execute
    timeout in force (past it, MultiprocExecutor declares a tensor-parallel worker dead)."""
    import os

    env = os.environ if environ is None else environ
    try:
        timeout = float(env.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") or EXECUTE_TIMEOUT_S)
    except ValueError:
        timeout = EXECUTE_TIMEOUT_S
    return max(0.1, timeout / 2)


RING_CAP = 4 << 30  # the most pinned memory the writer's share grows the ring to


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class Finished:
    """A finished request as the scheduler hands it to the worker: what to keep and where it is."""
    req_id: str
    sample_id: str
    line: int | None
    loss_mask: bytes
    token_ids: list[int]  # the kept prompt ids (len = rows to keep)
    block_ids: list[int]  # the request's blocks in the cache-only group, in position order


def slots_of(finished: list[Finished], block_size: int) -> torch.Tensor:
    """Cache slot of every kept row, all requests concatenated: [sum T] int64."""
    parts = []
    for f in finished:
        n = len(f.token_ids)
        blocks = torch.tensor(f.block_ids[: -(-n // block_size)], dtype=torch.int64)
        parts.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n])
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kv_cache [blocks, L, block_size, H] (vLLM's hidden-state cache layout), slots [T] -> [T, L, H]."""
    block_size = kv_cache.shape[2]
    return kv_cache[slots // block_size, :, slots % block_size]


def capture_chunks(kv_cache: torch.Tensor, slots: torch.Tensor, store_dtype: str, chunk_rows: int, emit) -> None:
    """Gather, check and encode `slots`' rows chunk by chunk: emit(start, stored [t, L, H],
    scales [t, L] | None, finite [t], zero [t, L]) for rows start..start+t. Each chunk's
    temporaries are dropped before the next is gathered, so at most one chunk's worth is alive."""
    for start in range(0, slots.shape[0], chunk_rows):
        rows = gather_rows(kv_cache, slots[start:start + chunk_rows])  # [t, L, H]
        faults.corrupt_rows(rows)
        out = prepare(rows, store_dtype)
        del rows
        emit(start, *out)
        del out
