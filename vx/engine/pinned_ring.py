"""A FIFO byte arena in pinned host memory for the capture's device-to-host copies (vx/engine/capture.py)."""

from __future__ import annotations

import collections
import threading

import torch

ALIGN = 64  # bytes; every view carved out of a ring slot starts aligned


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
