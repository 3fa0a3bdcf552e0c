"""The capture hot path on the worker: finished requests' cached rows -> checked, encoded states
-> the shard writer, without stalling the forward.

Per engine step, `CaptureSink.submit` gets every request that finished in the previous step, as
one list of cache slots. On a GPU it runs, on a side stream that waits for the compute stream
(never a sync of it):
  one gather of the rows            [sum T, L, H]   (vLLM's cache-only KV group)
  the checks' token flags           [sum T], [sum T, L]
  the store-dtype encoding          fp8 halves what crosses PCIe
  one async copy into a slot of a pinned ring, and an event.
The intake thread waits for the event, splits the batch into samples, rejects those whose flags
fail, copies the rest out of the ring (releasing the slot) and hands them to the ShardWriter,
whose own thread writes shards. On CPU the same steps run inline on the forward's own threads (a
second thread's torch ops would start a second OpenMP team on the same cores and slow the
forward more than the work itself costs). Hidden states never cross vLLM's RPC.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass

import torch

from .storage import STORE_DTYPES, flags_problem, prepare

ALIGN = 64  # bytes; every view carved out of a ring slot starts aligned


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


class PinnedRing:
    """A FIFO byte arena in pinned host memory: D2H copies land in slots that are reused once the
    intake thread has copied them out (released in the order they were taken). A request that
    does not fit waits for releases; one larger than the ring gets a buffer of its own."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.capacity = nbytes
        self._pin = pin
        self.arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._live: collections.deque = collections.deque()  # (start, end) in allocation order
        self._head = 0  # next free byte
        self._cond = threading.Condition()
        self.waits = 0  # times an allocation had to wait for the writer (backpressure)

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A [nbytes] uint8 buffer and the token to release it with."""
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if nbytes > self.capacity:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin), None
        with self._cond:
            while (start := self._fit(nbytes)) is None:
                self.waits += 1
                self._cond.wait()
            self._live.append((start, start + nbytes))
            self._head = start + nbytes
            return self.arena[start:start + nbytes], (start, start + nbytes)

    def _fit(self, n: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._head >= tail:  # free space: [head, capacity) then [0, tail)
            if self._head + n <= self.capacity:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None

    def release(self, token) -> None:
        if token is None:
            return
        with self._cond:
            if not self._live or self._live[0] != token:
                raise RuntimeError("vx: pinned ring slots released out of order")
            self._live.popleft()
            self._cond.notify_all()


def _region_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of a [shape] dtype tensor, those bytes rounded up to ALIGN)."""
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    return n, -(-n // ALIGN) * ALIGN


def _nbytes(shapes) -> int:
    return sum(_region_bytes(s, d)[1] for s, d in shapes)


def _carve(buf: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Typed views of consecutive aligned regions of a uint8 buffer."""
    out, off = [], 0
    for shape, dtype in shapes:
        n, padded = _region_bytes(shape, dtype)
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += padded
    return out


@dataclass
class _Batch:
    finished: list[Finished]
    stored: torch.Tensor | None = None  # [sum T, L, H] store dtype (host once ready)
    scales: torch.Tensor | None = None  # [sum T, L] fp8 only
    finite: torch.Tensor | None = None  # [sum T]
    zero: torch.Tensor | None = None    # [sum T, L]
    event: object = None                # CUDA event: the copy into the ring slot is done
    token: object = None                # ring slot to release


class CaptureSink:
    """Owns the worker side of one run: staging, checks, encoding and the ShardWriter."""

    def __init__(self, writer, store_dtype: str, device: torch.device, ring_bytes: int = 1 << 28,
                 max_queued: int = 8):
        self.writer = writer
        self.store_dtype = store_dtype
        self.cuda = device.type == "cuda"
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
        slots = slots_of(finished, block_size)
        batch = _Batch(finished)
        if not self.cuda:  # the same device work, inline: on the forward's own threads, since a
            # second thread's torch ops would start another OpenMP team on the same cores
            rows = gather_rows(kv_cache, slots)  # a copy: the blocks are free once it returns
            batch.stored, batch.scales, batch.finite, batch.zero = prepare(rows, self.store_dtype)
            self._queue.put(batch)
            return None
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(kv_cache.device))
        with torch.cuda.stream(stream):
            rows = gather_rows(kv_cache, slots.pin_memory().to(kv_cache.device, non_blocking=True))
            gathered = torch.cuda.Event()
            gathered.record(stream)
            stored, scales, finite, zero = prepare(rows, self.store_dtype)  # [T, L, H], [T, L] | None, [T], [T, L]
            t, layers, hidden = rows.shape
            shapes = [((t, layers, hidden), STORE_DTYPES[self.store_dtype]), ((t,), torch.bool),
                      ((t, layers), torch.bool)] + ([((t, layers), torch.float32)] if scales is not None else [])
            buf, batch.token = self._ring.alloc(_nbytes(shapes))
            host = _carve(buf, shapes)
            for dst, src in zip(host, [stored, finite, zero, scales]):
                dst.copy_(src, non_blocking=True)
            batch.event = torch.cuda.Event()
            batch.event.record(stream)
        batch.stored, batch.finite, batch.zero = host[:3]
        batch.scales = host[3] if scales is not None else None
        self._queue.put(batch)
        return gathered

    # ---- intake thread -------------------------------------------------------------------
    def _intake(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is not None:
                self._release(batch)
                continue
            try:
                self._take(batch)
            except BaseException as e:  # reported to the driver by status(); the engine goes on
                self._error = e
            finally:
                self._release(batch)

    def _release(self, batch: _Batch) -> None:
        if self._ring is not None:
            self._ring.release(batch.token)

    def _take(self, b: _Batch) -> None:
        if b.event is not None:  # GPU: wait for the copy into the ring, then copy out of it
            b.event.synchronize()
            # out of the ring at once (one memcpy per batch), so the slot is reused next step
            b.stored = b.stored.clone()
            b.scales = b.scales.clone() if b.scales is not None else None
        start = 0
        for f in b.finished:
            end = start + len(f.token_ids)
            problem = flags_problem(b.finite[start:end], b.zero[start:end])
            if problem:
                self.writer.reject(f.sample_id, problem, f.line)
            else:
                self.writer.add_encoded(f.sample_id, f.token_ids, f.loss_mask, b.stored[start:end],
                                        b.scales[start:end] if b.scales is not None else None, f.line)
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
