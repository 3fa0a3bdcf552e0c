"""The capture hot path on the worker, host side: chunks in the pinned ring -> the shard writer,
without stalling the forward and without copying the states on the host.

The forward thread stages each chunk (vx/engine/capture.py) into a slot of a pinned ring sized
by the driver: RING_STEPS full steps for the copies in flight, and a share the writer may hold.
The intake thread waits for each chunk's event and, once a group is complete, splits it into
samples, rejects those whose token flags fail and hands the rest to the ShardWriter as views of
their slots: the writer's thread writes the shard from the ring itself and releases the slots
once it is committed. A group that would take the writer past its share is copied out of the
ring instead (a memcpy, the slots freed at once). When the forward finds no room, the writer
commits its open shard early (its slots are the oldest), so a ring smaller than a shard never
stalls. On CPU the same device steps run inline on the forward's own threads (a second thread's
torch ops would start a second OpenMP team on the same cores and slow the forward more than the
work itself costs). Hidden states never cross vLLM's RPC.
"""

from __future__ import annotations

import collections
import queue
import time
import threading

import torch

from vx.engine.capture import Finished, capture_chunks, execute_wait_bound_s, slots_of
from vx.engine.pinned_ring import Hold, PinnedRing, carve, nbytes
from vx.engine.staged import Chunk, Group
from vx.store.encoding import flags_problem


COPY_BYTES = 1 << 30  # device bytes of encoded chunks waiting for their copy into the ring
FLUSH = object()  # queued when the forward waits for ring space: the writer commits what it holds
class CaptureSink:
    """Owns the worker side of one run: staging, checks, encoding and the ShardWriter.
    chunk_rows, ring_bytes and hold_bytes come from the driver (capture_budget). A GPU stages
    through the pinned ring; on CPU the device work runs inline, unless staging="ring" (tests and
    the host-headroom bench run the ring path there, in pageable memory, without streams)."""

    def __init__(self, writer, store_dtype: str, device: torch.device, ring_bytes: int = 1 << 28,
                 chunk_rows: int = 8192, max_queued: int = 64, hold_bytes: int | None = None,
                 staging: str = "auto", writer_hold_s: float = 0.0, copy_bytes: int | None = None):
        if staging not in ("auto", "ring", "inline"):
            raise ValueError(f"staging must be auto, ring or inline, got {staging!r}")
        self.writer = writer
        self.store_dtype = store_dtype
        self.cuda = device.type == "cuda"
        self.chunk_rows = max(1, int(chunk_rows))
        self.ring_bytes = int(ring_bytes)
        self.hold_bytes = int(ring_bytes // 2 if hold_bytes is None else hold_bytes)
        self.received = 0  # samples handed to submit()
        self.tokens = 0
        self.zero_copy_rows = 0  # rows the writer wrote straight from the ring
        self.copied_rows = 0     # rows copied out of it (the writer's share was full, or a huge group)
        ring = staging == "ring" or (staging == "auto" and self.cuda)
        self._ring = PinnedRing(self.ring_bytes, pin=self.cuda) if ring else None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._copies: collections.deque = collections.deque()  # (event, bytes): chunks' copies in flight
        self._copy_bytes = 0
        # vx selftest's backpressure stage: 0, every copy awaited
        self.copy_bytes = COPY_BYTES if copy_bytes is None else int(copy_bytes)
        self._held = 0  # ring bytes the writer holds
        self._held_lock = threading.Lock()
        self._pending: Group | None = None  # the zero-copy group being assembled
        # the ring path's queue is bounded by the ring (and by the spills, one per wait_bound_s);
        # a bounded queue would make the forward wait on the writer without limit
        self._queue: queue.Queue = queue.Queue(maxsize=0 if ring else max_queued)
        self.wait_bound_s = execute_wait_bound_s()
        self._deadline = 0.0  # the step's: all of its chunks' waits for ring space end by it
        self._error: BaseException | None = None
        self.intake_cpu_s = 0.0
        self.writer_hold_s = float(writer_hold_s)  # vx selftest's backpressure stage: the intake
        # starts once the forward has waited for ring space (at most this late), as behind a slow disk
        self._thread = threading.Thread(target=self._intake, name="vx-capture-intake", daemon=True)
        self._thread.start()

    @property
    def host_threads(self) -> list[int]:
        """Native ids of the threads doing the host's share (the intake and the shard writer)."""
        return [self._thread.native_id, self.writer.thread_id]

    # ---- forward thread ------------------------------------------------------------------
    def submit(self, kv_cache: torch.Tensor, finished: list[Finished], block_size: int) -> None:
        """Capture these requests, whose rows the step just computed. Once this returns, any later
        kernel on the compute stream may overwrite their blocks: the gather and the encoding are
        enqueued on it (on a GPU; inline on CPU), only each chunk's copy into the ring on the side
        stream, overlapping the next forward."""
        self.received += len(finished)
        self.tokens += sum(len(f.token_ids) for f in finished)
        if self._error is not None:  # the writer failed: the driver reports it
            return
        slots = slots_of(finished, block_size)  # [sum T]
        group = Group(finished, int(slots.shape[0]))
        if not group.rows:
            return
        if self._ring is None:  # the same device work, inline: on the forward's own threads, since
            # a second thread's torch ops would start another OpenMP team on the same cores
            capture_chunks(kv_cache, slots, self.store_dtype, self.chunk_rows,
                           lambda *a: group.put(*a, adopt=True))  # copies
            self._queue.put(Chunk(group))
            return
        # one bound for the whole step, however many chunks it has: a bound per chunk let a step
        # of k chunks wait k times as long, past vLLM's execute timeout from the second chunk on
        self._deadline = time.monotonic() + self.wait_bound_s
        if not self.cuda:
            capture_chunks(kv_cache, slots, self.store_dtype, self.chunk_rows, lambda *a: self._to_ring(group, *a))
            return
        compute = torch.cuda.current_stream(kv_cache.device)
        slots = slots.pin_memory().to(kv_cache.device, non_blocking=True)
        capture_chunks(kv_cache, slots, self.store_dtype, self.chunk_rows,
                       lambda *a: self._to_ring(group, *a, compute=compute))

    def _to_ring(self, group, start, stored, scales, finite, zero, compute=None) -> None:
        """One chunk ([t, L, H], [t, L] | None, [t], [t, L]) copied into a ring slot (on a GPU: by
        the side stream once the compute stream has encoded it; the chunk's device tensors are not
        reused before the copy is done, and at most COPY_BYTES of them wait for their copies)."""
        regions = [stored, finite, zero] + ([scales] if scales is not None else [])
        shapes = [(tuple(x.shape), x.dtype) for x in regions]
        size = nbytes(shapes)
        # waits while the ring is full, never past the bound: vLLM would declare the worker dead
        buf, token = self._ring.alloc(size, on_wait=self._ask_flush,
                                      timeout=max(0.0, self._deadline - time.monotonic()))
        host = carve(buf, shapes)
        event = None
        if compute is None:
            for dst, src in zip(host, regions):
                dst.copy_(src)
        else:
            stream = self._stream
            stream.wait_stream(compute)  # the chunk's gather and encoding
            with torch.cuda.stream(stream):
                for dst, src in zip(host, regions):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # the allocator reuses it only once the copy is done
            event = torch.cuda.Event(blocking=True)  # the intake sleeps in synchronize() instead of spinning a core
            event.record(stream)
            self._bound_copies(event, size)
        t = stored.shape[0]
        self._queue.put(Chunk(group, start, t, [host[0], host[3] if scales is not None else None, host[1], host[2]],
                               event, Hold(self._ring, token, size), last=start + t == group.rows))

    def _bound_copies(self, event, size: int) -> None:
        """Device memory the chunks waiting for their copies hold, outside vLLM's budget: past
        copy_bytes (COPY_BYTES; a full 16k-token step of a 27B target's rows, 840 MB, stays below
        it) the forward thread waits for the oldest copies."""
        self._copies.append((event, size))
        self._copy_bytes += size
        while self._copies and (self._copy_bytes > self.copy_bytes or self._copies[0][0].query()):
            done, n = self._copies.popleft()
            done.synchronize()
            self._copy_bytes -= n

    def _ask_flush(self) -> None:
        """The ring is full: the writer's open shard may hold the oldest slot, so commit it now
        (a shard smaller than asked) rather than wait for rows that cannot be staged."""
        self._queue.put(FLUSH)

    # ---- intake thread -------------------------------------------------------------------
    def _intake(self) -> None:
        deadline = time.monotonic() + self.writer_hold_s
        while self.writer_hold_s and self.ring_waits == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        while (chunk := self._queue.get()) is not None:
            if chunk is FLUSH:
                if self._error is None:
                    try:
                        self.writer.flush()
                    except BaseException as e:
                        self._error = e
                continue
            try:
                if self._error is None:
                    self._take(chunk)  # consumes the chunk's slot reference, whatever happens
                elif chunk.hold is not None:
                    chunk.hold.drop()
            except BaseException as e:  # reported to the driver by status(); the engine goes on
                self._error = e
                self._drop_pending()
        self._drop_pending()
        self.intake_cpu_s = time.thread_time()  # this thread's CPU seconds (vx selftest shows them)

    def _drop_pending(self) -> None:
        g, self._pending = self._pending, None
        for c in g.chunks if g is not None else ():
            c.hold.drop()

    def _freed(self, n: int) -> None:
        with self._held_lock:
            self._held -= n

    def _take(self, c: Chunk) -> None:
        g = c.group
        if c.host is not None:  # a ring slot: wait for its copy, then keep it or copy out of it
            kept = False
            try:
                if c.event is not None:
                    c.event.synchronize()
                if c.start == 0:  # the group's first chunk decides for the group
                    row = c.hold.nbytes / max(1, c.rows)
                    with self._held_lock:
                        g.zero_copy = self._held + g.rows * row <= self.hold_bytes
                if g.zero_copy:
                    with self._held_lock:
                        self._held += c.hold.nbytes
                    c.hold.on_free = self._freed
                    g.chunks.append(c)
                    self._pending, kept = g, True
                else:
                    g.put(c.start, *c.host)
                    self.copied_rows += c.rows
            finally:
                if not kept:
                    c.hold.drop()
        if not c.last:
            return
        self._pending = None
        try:
            self._emit(g)
        finally:
            for ch in g.chunks:  # the intake's own references; the writer's keep the slots
                ch.hold.drop()

    def _emit(self, g: Group) -> None:
        """A complete group: reject samples whose flags fail, hand the rest to the writer."""
        if g.zero_copy:
            finite = torch.cat([c.host[2] for c in g.chunks])
            zero = torch.cat([c.host[3] for c in g.chunks])
            self.zero_copy_rows += g.rows
        else:
            finite, zero = g.finite, g.zero
        start = 0
        for f in g.finished:
            end = start + len(f.token_ids)
            problem = flags_problem(finite[start:end], zero[start:end])
            if problem:
                self.writer.reject(f.sample_id, problem, f.line)
            elif g.zero_copy:
                scales = g.pieces(start, end, 1) if g.chunks[0].host[1] is not None else None
                self.writer.add_encoded(f.sample_id, f.token_ids, f.loss_mask, g.pieces(start, end, 0), scales,
                                        f.line, holds=[h.take() for h in g.holds(start, end)])
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

    @property
    def ring_spills(self) -> int:
        return self._ring.spills if self._ring is not None else 0
