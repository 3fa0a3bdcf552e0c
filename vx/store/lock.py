"""Who writes a directory: an flock'd file that names its holder and dies with it.

On a filesystem shared by hosts (NFS, Lustre) an flock may not reach from one host to another.
An output's lock (hold()) therefore also records its holder (host, pid, start) with a heartbeat
its holder rewrites every HEARTBEAT_S seconds, and clears when it lets go: a writer on another
host that finds a heartbeat younger than STALE_S refuses, as a second writer on this host does.
A holder killed without letting go leaves a heartbeat that goes stale within STALE_S.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

HEARTBEAT_S = float(os.environ.get("VX_LOCK_HEARTBEAT_S", "10"))
STALE_S = float(os.environ.get("VX_LOCK_STALE_S", "60"))  # a heartbeat older than this is a dead writer's

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


class Hold:
    """An output's lock held by this process: flock'd, its record's heartbeat kept fresh by a thread."""

    def __init__(self, f):
        self.f, self._stop = f, threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="vx-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.f.seek(0)
        self.f.truncate()
        self.f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()}) + "\n")
        self.f.flush()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except OSError:  # the next beat tries again; a stale one makes others wait, never write beside us
                pass

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.f.seek(0)
        self.f.truncate()  # let go: a writer on another host may start at once
        self.f.close()


def hold(path: Path):
    """Take an output's lock: (Hold, None), or (None, holder) where a live process on this host
    holds its flock or a record names a writer on another host whose heartbeat is fresh."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = describe(f.read())
        f.close()
        return None, holder or "another process"
    f.seek(0)
    other = other_host(f.read())
    if other:
        f.close()
        return None, other
    return Hold(f), None


def describe(record: str) -> str:
    try:
        rec = json.loads(record)
    except ValueError:
        return record.strip()
    return f"pid {rec['pid']} on {rec['host']}"


def other_host(record: str) -> str | None:
    """The holder a lock's record names where it is a writer on another host with a fresh heartbeat."""
    try:
        rec = json.loads(record)
        host, age = rec["host"], time.time() - float(rec["heartbeat"])
    except (ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname() or age > STALE_S:
        return None
    return (f"pid {rec['pid']} on {host}, another host sharing this filesystem, whose heartbeat is {max(age, 0):.0f} s "
            f"old; a writer killed there lets go {STALE_S:.0f} s after its last heartbeat")


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
