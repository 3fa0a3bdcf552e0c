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


def temp_for(target: Path) -> Path:
    """Where to write `target` before its atomic rename: a name of this host and process, so that
    drop_dead_temps can tell a dead writer's leftover from a live one's."""
    target = Path(target)
    return target.with_name(f".{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def write_atomically(target: Path, data: str | bytes, durable: bool = False) -> None:
    """target holds all of data or what it held before, never a part: a temp_for file, renamed
    (durable: fsynced before the rename, so a power loss cannot leave an empty file behind it)."""
    tmp = temp_for(target)
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, target)


def drop_dead_temps(directory: Path) -> None:
    """Remove temp_for files of processes of this host that died before their rename (a kill -9
    there would leave them for good); other hosts' and live processes' are left alone."""
    host = socket.gethostname()
    for tmp in Path(directory).glob(f".*.{host}.*.tmp"):
        pid = tmp.name[:-len(".tmp")].rpartition(".")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
