"""Who writes a directory: an flock'd file that names its holder and dies with it."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

WRITER_LOCK = ".vx-writer-lock"  # held by the process whose ShardWriter writes into the directory


def try_lock(path: Path):
    """Take an exclusive flock on path without waiting and record who holds it ('pid N on host').
    Returns (open file, None): held until the file is closed or this process dies; or
    (None, holder) when a live process holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return None, holder
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f, None


def live_writer(out_dir: Path) -> str | None:
    """Who holds out_dir's writer lock ('pid N on host'), or None when no live process does. An
    engine left running by a killed driver still holds it, so a rerun beside it stops at once."""
    path = Path(out_dir) / WRITER_LOCK
    if not path.exists():
        return None
    f, holder = try_lock(path)
    if f is not None:
        f.close()
    return holder
