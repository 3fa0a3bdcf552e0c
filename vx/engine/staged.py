"""A step's captured rows on the host: the group of requests the capture got in one call, and
each chunk of it in a slot of the pinned ring (vx/engine/sink.py stages them; the intake thread
assembles them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vx.engine.capture import Finished
from vx.engine.pinned_ring import Hold


@dataclass
class Group:
    """The requests one capture call got (those a step completed), their rows assembled on the host chunk by chunk: kept
    in their ring slots (zero_copy) or copied out of them into host tensors."""
    finished: list[Finished]
    rows: int
    zero_copy: bool = False
    chunks: list = field(default_factory=list)  # zero_copy: the group's Chunks, in row order
    stored: torch.Tensor | None = None  # [sum T, L, H] store dtype
    scales: torch.Tensor | None = None  # [sum T, L] fp8 only
    finite: torch.Tensor | None = None  # [sum T]
    zero: torch.Tensor | None = None    # [sum T, L]

    def put(self, start: int, stored, scales, finite, zero, adopt: bool = False) -> None:
        """Rows start..start+t of the group (host tensors), copied; adopt: a chunk that is the
        whole group is kept as it is (the CPU path's own fresh tensors)."""
        t = stored.shape[0]
        if adopt and start == 0 and t == self.rows and self.stored is None:
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

    def pieces(self, start: int, end: int, region: int) -> list[torch.Tensor]:
        """zero_copy: views of rows start..end of one region (0 stored, 1 scales) in the ring."""
        out = []
        for c in self.chunks:
            a, b = max(start, c.start), min(end, c.start + c.rows)
            if a < b:
                out.append(c.host[region][a - c.start:b - c.start])
        return out or [self.chunks[0].host[region][:0]]

    def holds(self, start: int, end: int) -> list[Hold]:
        return [c.hold for c in self.chunks if max(start, c.start) < min(end, c.start + c.rows)]


@dataclass
class Chunk:
    """One chunk of a group in a ring slot, or a group already complete on the host (CPU)."""
    group: Group
    start: int = 0
    rows: int = 0
    host: list | None = None  # ring views: stored, scales | None, finite, zero
    event: object = None      # CUDA event: the copy into the ring slot is done (None: done)
    hold: Hold | None = None  # the ring slot
    last: bool = True
