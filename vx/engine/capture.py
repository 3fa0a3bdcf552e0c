"""The capture hot path on the worker: finished requests' cached rows -> checked, encoded states
-> the shard writer, without stalling the forward.

Per engine step, `CaptureSink.submit` gets every request that finished in the previous step, as
one list of cache slots: a group of rows. On a GPU it runs, on a side stream that waits for the
compute stream (never a sync of it), chunk by chunk of at most `chunk_rows` rows:
  a gather of the chunk's rows      [t, L, H]   (vLLM's cache-only KV group)
  the checks' token flags           [t], [t, L]
  the store-dtype encoding          fp8 halves what crosses PCIe
  one async copy into a slot of a pinned ring, and an event.
So the device memory the capture takes outside vLLM's budget is bounded by the chunk, not by the
finished requests' lengths (one 60k-token sample of a 27B target would need ~15 GB at once), and
the ring, sized by the driver for at least 3 full steps, takes every chunk without a fresh pinned
allocation. The intake thread waits for each chunk's event, copies it out of the ring into the
group's host tensors (releasing the slot), and once a group is complete splits it into samples,
rejects those whose flags fail and hands the rest to the ShardWriter, whose own thread writes
shards. On CPU the same steps run inline on the forward's own threads (a second thread's torch ops
would start a second OpenMP team on the same cores and slow the forward more than the work itself
costs). Hidden states never cross vLLM's RPC. Every step is row-local, so the shards are
bit-identical whatever the chunk size.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from vx import faults
from vx.engine.pinned_ring import ALIGN, PinnedRing, carve, nbytes
from vx.store.encoding import STORE_DTYPES, flags_problem, prepare

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
                   cache_dtype: torch.dtype = torch.bfloat16, device_bytes: int = DEVICE_BYTES) -> dict:
    """What the driver gives the worker: rows per chunk (a full step at most, and within
    device_bytes) and the pinned ring's size (RING_STEPS full steps of encoded rows)."""
    chunk_rows = max(1, min(step_tokens, device_bytes // device_row_bytes(layers, hidden, store_dtype, cache_dtype)))
    slot_slack = 4 * ALIGN  # each region of a slot is rounded up to ALIGN
    steps = -(-step_tokens // chunk_rows)  # chunks per full step
    ring = RING_STEPS * (step_tokens * store_row_bytes(layers, hidden, store_dtype) + steps * slot_slack)
    return {"chunk_rows": int(chunk_rows), "ring_bytes": int(ring)}


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


@dataclass
class _Group:
    """The requests finished in one step, their rows assembled on the host chunk by chunk."""
    finished: list[Finished]
    rows: int
    stored: torch.Tensor | None = None  # [sum T, L, H] store dtype
    scales: torch.Tensor | None = None  # [sum T, L] fp8 only
    finite: torch.Tensor | None = None  # [sum T]
    zero: torch.Tensor | None = None    # [sum T, L]

    def put(self, start: int, stored, scales, finite, zero) -> None:
        """Rows start..start+t of the group (host tensors); a chunk that is the whole group is adopted."""
        t = stored.shape[0]
        if start == 0 and t == self.rows and self.stored is None:
            self.stored, self.scales, self.finite, self.zero = stored, scales, finite, zero
            return
        if self.stored is None:
            self.stored = stored.new_empty((self.rows, *stored.shape[1:]))
            self.scales = scales.new_empty((self.rows, *scales.shape[1:])) if scales is not None else None
            self.finite = finite.new_empty((self.rows,))
            self.zero = zero.new_empty((self.rows, *zero.shape[1:]))
        self.stored[start:start + t].copy_(stored)
        if scales is not None:
            self.scales[start:start + t].copy_(scales)
        self.finite[start:start + t].copy_(finite)
        self.zero[start:start + t].copy_(zero)


@dataclass
class _Chunk:
    """One chunk of a group in a ring slot (GPU), or a group already complete on the host (CPU)."""
    group: _Group
    start: int = 0
    host: list | None = None  # ring views: stored, scales | None, finite, zero
    event: object = None      # CUDA event: the copy into the ring slot is done
    token: object = None      # ring slot to release
    last: bool = True


class CaptureSink:
    """Owns the worker side of one run: staging, checks, encoding and the ShardWriter.
    chunk_rows and ring_bytes come from the driver (capture_budget)."""

    def __init__(self, writer, store_dtype: str, device: torch.device, ring_bytes: int = 1 << 28,
                 chunk_rows: int = 8192, max_queued: int = 64):
        self.writer = writer
        self.store_dtype = store_dtype
        self.cuda = device.type == "cuda"
        self.chunk_rows = max(1, int(chunk_rows))
        self.ring_bytes = int(ring_bytes)
        self.received = 0  # samples handed to submit()
        self.tokens = 0
        self._ring = PinnedRing(ring_bytes) if self.cuda else None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._intake, name="vx-capture-intake", daemon=True)
        self._thread.start()

    # ---- forward thread ------------------------------------------------------------------
    def submit(self, kv_cache: torch.Tensor, finished: list[Finished], block_size: int):
        """Start capturing these finished requests. Returns a CUDA event that completes when their
        cache blocks may be reused (None: already free, as on CPU)."""
        self.received += len(finished)
        self.tokens += sum(len(f.token_ids) for f in finished)
        if self._error is not None:  # the writer failed: the driver reports it; free the blocks
            return None
        slots = slots_of(finished, block_size)  # [sum T]
        group = _Group(finished, int(slots.shape[0]))
        if not group.rows:
            return None
        if not self.cuda:  # the same device work, inline: on the forward's own threads, since a
            # second thread's torch ops would start another OpenMP team on the same cores
            capture_chunks(kv_cache, slots, self.store_dtype, self.chunk_rows, group.put)  # copies: blocks free
            self._queue.put(_Chunk(group))
            return None
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(kv_cache.device))
        with torch.cuda.stream(stream):
            slots = slots.pin_memory().to(kv_cache.device, non_blocking=True)

            def to_ring(start, stored, scales, finite, zero):  # [t, L, H], [t, L] | None, [t], [t, L]
                regions = [stored, finite, zero] + ([scales] if scales is not None else [])
                shapes = [(tuple(x.shape), x.dtype) for x in regions]
                buf, token = self._ring.alloc(nbytes(shapes))  # waits while the ring is full
                host = carve(buf, shapes)
                for dst, src in zip(host, regions):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                chunk = _Chunk(group, start, [host[0], host[3] if scales is not None else None, host[1], host[2]],
                               event, token, last=start + stored.shape[0] == group.rows)
                self._queue.put(chunk)

            capture_chunks(kv_cache, slots, self.store_dtype, self.chunk_rows, to_ring)
            gathered = torch.cuda.Event()  # after the last chunk's gather: the blocks may be reused
            gathered.record(stream)
        return gathered

    # ---- intake thread -------------------------------------------------------------------
    def _intake(self) -> None:
        while (chunk := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._take(chunk)
            except BaseException as e:  # reported to the driver by status(); the engine goes on
                self._error = e
            finally:
                if self._ring is not None:
                    self._ring.release(chunk.token)

    def _take(self, c: _Chunk) -> None:
        if c.host is not None:  # GPU: wait for the copy into the ring, then copy out of it at once
            c.event.synchronize()  # (one memcpy per chunk), so the slot is reused for the next
            parts = c.host
            if c.start == 0 and c.last:  # the whole group in one chunk: adopt a copy of the slot
                parts = [x.clone() if x is not None else None for x in parts]
            c.group.put(c.start, *parts)
        if not c.last:
            return
        g, start = c.group, 0
        for f in g.finished:
            end = start + len(f.token_ids)
            problem = flags_problem(g.finite[start:end], g.zero[start:end])
            if problem:
                self.writer.reject(f.sample_id, problem, f.line)
            else:
                self.writer.add_encoded(f.sample_id, f.token_ids, f.loss_mask, g.stored[start:end],
                                        g.scales[start:end] if g.scales is not None else None, f.line)
            start = end

    # ---- driver RPCs -----------------------------------------------------------------------
    def error(self) -> str | None:
        e = self._error or self.writer.error
        return None if e is None else str(e)

    def close(self) -> None:
        """Drain the intake, then commit the last shard (raises what failed first)."""
        self._queue.put(None)
        self._thread.join()
        try:
            self.writer.close()
        finally:
            if self._error is not None:
                raise self._error

    @property
    def ring_waits(self) -> int:
        return self._ring.waits if self._ring is not None else 0
