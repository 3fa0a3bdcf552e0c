"""Failpoints for crash and fault tests: `VX_FAULT=name:n` acts at the n-th pass of point `name`.

Kill points end the process with SIGKILL (what a dead machine does); `enospc` raises
OSError(ENOSPC). Unset in production: one dict lookup per point.
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
    _count += 1
    if _count != _TARGET:
        return
    if name == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    os.kill(os.getpid(), signal.SIGKILL)
