"""Failpoints for crash and fault tests: `VX_FAULT=name:n` acts at the n-th pass of point `name`.

Kill points end the process with SIGKILL (what a dead machine does; `engine-step`, at each step
warm-up included, and `engine-sample`, as a sample finishes, are in the vLLM engine core: they
kill the engine under a live driver); `enospc` raises
OSError(ENOSPC). `VX_FAULT=corrupt-layer:j` is not a kill point: the capture path shifts layer
position j of every captured chunk by one token (the rows of token t hold token t-1's states),
the silent kind of wrong that `vx selftest` and `vx extract --verify` must catch. `VX_FAULT_PARTITION=i` limits the fault to the worker of partition i;
`VX_FAULT_ONCE=FILE` fires it only if FILE does not exist yet (and creates it), so a retried
worker runs clean. Unset in production: one string comparison per point.
"""

from __future__ import annotations

import errno
import os
import signal

_spec = os.environ.get("VX_FAULT", "")
_NAME, _, _N = _spec.partition(":")
_TARGET = int(_N or 1) if _NAME else 0
_count = 0


def point(name: str) -> None:
    global _count
    if name != _NAME:
        return
    only = os.environ.get("VX_FAULT_PARTITION")
    if only is not None and os.environ.get("VX_PARTITION") != only:
        return
    _count += 1
    if _count != _TARGET:
        return
    once = os.environ.get("VX_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    if name == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt_rows(rows) -> None:
    """The corrupt-layer failpoint: rows [T, L, H] of a captured chunk, changed in place."""
    if _NAME != "corrupt-layer" or rows.shape[0] < 2:
        return
    j = int(_N or 0)
    if 0 <= j < rows.shape[1]:
        rows[:, j] = rows[:, j].roll(1, dims=0)
