"""A FIFO byte arena in pinned host memory for the capture's device-to-host copies (vx/engine/capture.py)."""

from __future__ import annotations

import collections
import threading
import time

import torch

ALIGN = 64  # bytes; every view carved out of a ring slot starts aligned


class PinnedRing:
    """A FIFO byte arena in pinned host memory: D2H copies land in slots, which the shard writer
    writes from directly (vx/engine/sink.py) and which are reused once released. Slots may be
    released in any order; space is reused from the oldest live slot on, so a slot released early
    frees its bytes once every slot taken before it is released too. A request that does not fit
    waits for releases; one larger than the ring gets a buffer of its own."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.capacity = nbytes
        self._pin = pin
        self.arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._live: collections.deque = collections.deque()  # (start, end) in allocation order
        self._freed: set = set()  # live slots released, behind an older slot still held
        self._head = 0  # next free byte
        self._cond = threading.Condition()
        self.waits = 0  # times an allocation had to wait for the writer (backpressure)
        self.spills = 0  # allocations that waited their whole timeout and got a buffer of their own

    def alloc(self, nbytes: int, on_wait=None, timeout: float | None = None) -> tuple[torch.Tensor, object]:
        """A [nbytes] uint8 buffer and the token to release it with. on_wait: called once, outside
        the ring's lock, before the first wait for space (the capture asks its writer to commit
        the slots it holds). timeout: the longest wait for space, in seconds; past it the request
        gets a buffer of its own (token None, counted in `spills`): the forward that asks must
        not outwait vLLM's execute timeout, which would declare its worker dead."""
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)  # never empty: live slots stay distinct
        if nbytes > self.capacity:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin), None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (start := self._fit(nbytes)) is None:
                if on_wait is not None:
                    self._cond.release()
                    try:
                        on_wait()
                    finally:
                        self._cond.acquire()
                    on_wait = None
                    continue
                self.waits += 1
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.spills += 1
                    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin), None
                self._cond.wait(left)
            self._live.append((start, start + nbytes))
            self._head = start + nbytes
            return self.arena[start:start + nbytes], (start, start + nbytes)

    def _fit(self, n: int) -> int | None:
        """Where n bytes start, or None while they do not fit. Live bytes run from the oldest live
        slot's start (tail) to head, wrapping at most once; slots are never empty, so with a slot
        live, head == tail means the bytes wrapped round to the tail: the ring is full."""
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # not wrapped: free space is [head, capacity) then [0, tail)
            if self._head + n <= self.capacity:
                return self._head
            return 0 if n <= tail else None
        # wrapped (head <= tail): free space is [head, tail) only; head == tail is a full ring
        return self._head if self._head + n <= tail else None

    def release(self, token) -> None:
        if token is None:
            return
        with self._cond:
            if token in self._freed or token not in self._live:
                raise RuntimeError(f"vx: pinned ring slot {token} released twice or never taken")
            self._freed.add(token)
            while self._live and self._live[0] in self._freed:
                self._freed.discard(self._live.popleft())
            self._cond.notify_all()


def _region_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of a [shape] dtype tensor, those bytes rounded up to ALIGN)."""
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    return n, -(-n // ALIGN) * ALIGN


def nbytes(shapes) -> int:
    return sum(_region_bytes(s, d)[1] for s, d in shapes)


def carve(buf: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Typed views of consecutive aligned regions of a uint8 buffer."""
    out, off = [], 0
    for shape, dtype in shapes:
        n, padded = _region_bytes(shape, dtype)
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += padded
    return out


class Hold:
    """The references to one ring slot: the capture's own while it assembles the slot's rows, and
    one per sample the shard writer keeps views of until the shard is committed. The slot is
    released when the last reference is dropped (by whichever thread drops it)."""

    __slots__ = ("_ring", "_token", "_refs", "_lock", "nbytes", "on_free")

    def __init__(self, ring: PinnedRing, token, nbytes: int):
        self._ring, self._token, self.nbytes = ring, token, nbytes
        self._refs = 1
        self._lock = threading.Lock()
        self.on_free = None  # called with nbytes once the slot is released

    def take(self) -> "Hold":
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("vx: a released ring slot was referenced again")
            self._refs += 1
        return self

    def drop(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._ring.release(self._token)
            if self.on_free is not None:
                self.on_free(self.nbytes)
