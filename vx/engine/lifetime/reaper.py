"""The engine dies with its driver, SIGKILL included.

vLLM's engine core is a child process of the driver that nothing ties to the driver's life: a
driver killed with SIGKILL (or preempted, OOM-killed) leaves it running, holding the GPU and
still committing shards. vLLM starts it with fork or spawn, so vx cannot run code in it first
(PR_SET_PDEATHSIG has to be set by the child itself). Instead a tiny watcher process, started
before the engine in a session of its own, records the driver's descendants every 0.1 s and, as
soon as the driver is gone without saying goodbye, SIGKILLs every one it saw (pid and start time
matched, so a reused pid is never hit). vLLM's own workers die with the engine core anyway.

    python -m vx.engine.lifetime.reaper DRIVER_PID      # stdin: "ok" from the driver on a normal close

The driver is checked every 0.1 s; its process tree is scanned every tick for the first 30 s (the
engine starts its processes then) and every 2 s afterwards (cheap on the CPU the engine uses).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

TICK_S = 0.1
FAST_SCAN_S, SLOW_SCAN_S = 30.0, 2.0


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])


def descendants(root: int, known: dict | None = None) -> dict[int, int]:
    """{pid: start time} of every live descendant of root. `known` ({pid: (parent, start time)},
    kept by the caller between scans) spares re-reading every process's stat on each scan: only a
    pid new since the last listing is read (a pid reused between two scans would take the kernel's
    whole pid space in 2 s), and a pid gone from the listing is forgotten. A process that lost its
    parent was already found under it."""
    known = {} if known is None else known
    live = {int(e) for e in os.listdir("/proc") if e.isdigit()}
    for pid in known.keys() - live:
        del known[pid]
    for pid in live - known.keys():
        if (st := _stat(pid)) is not None:
            known[pid] = (st[0], st[2])
    children: dict[int, list[tuple[int, int]]] = {}
    for pid, (parent, start) in known.items():
        children.setdefault(parent, []).append((pid, start))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def watch(driver: int) -> None:
    me, t0, last_scan = os.getpid(), time.monotonic(), 0.0
    birth = _stat(driver)
    seen: dict[int, int] = {}
    known: dict[int, tuple[int, int]] = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], TICK_S)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "ok":
                return  # the driver closed its engine itself
        st = _stat(driver)
        if st is not None and st[1] != "Z" and birth is not None and st[2] == birth[2]:
            now = time.monotonic()
            if now - t0 < FAST_SCAN_S or now - last_scan >= SLOW_SCAN_S:
                seen.update(descendants(driver, known))
                last_scan = now
            if not ready or line:
                continue
        # the driver is gone (or closed our pipe without goodbye): kill what it left behind
        for pid, start in seen.items():
            if pid != me and (s := _stat(pid)) is not None and s[2] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return


DRIVER_ENV = "VX_DRIVER"  # "pid:start time" of the driver, inherited by every engine process


def mark_driver() -> None:
    """Called by the driver before it starts the engine: its processes inherit who the driver is."""
    os.environ[DRIVER_ENV] = f"{os.getpid()}:{_stat(os.getpid())[2]}"


def _driver_gone(mark: str) -> bool:
    """Whether the driver a VX_DRIVER mark names has died (gone, a zombie, or its pid reused)."""
    pid, start = map(int, mark.split(":"))
    st = _stat(pid)
    return st is None or st[1] == "Z" or st[2] != start


def require_driver() -> None:
    """In an engine process, before a commit: if the driver is gone, exit instead of committing
    (the reaper kills this process within a tick anyway; this closes that window)."""
    mark = os.environ.get(DRIVER_ENV)
    if mark and _driver_gone(mark):
        os._exit(1)


WATCH_S = 1.0
_watching = False


def watch_driver(period_s: float = WATCH_S) -> bool:
    """In an engine's worker process, once its engine has started: a daemon thread that ends the
    engine when the driver is gone. The reaper does that from outside within a tick; this is the
    second line, for when the reaper died with the driver (`pkill -9 -f vx`, a kill of every
    process by name): the worker SIGKILLs its parent, the engine core (a process of the same
    driver: vLLM's own shutdown after a lost worker takes ~5-10 s), then exits. False without a
    driver mark."""
    global _watching
    mark = os.environ.get(DRIVER_ENV)
    if not mark:
        return False
    if _watching:
        return True
    core = os.getppid()

    def watch() -> None:
        while not _driver_gone(mark):
            time.sleep(period_s)
        try:
            environ = Path(f"/proc/{core}/environ").read_bytes().split(b"\0")
            if f"{DRIVER_ENV}={mark}".encode() in environ:
                os.kill(core, signal.SIGKILL)
        except OSError:
            pass
        os._exit(1)

    import threading

    threading.Thread(target=watch, name="vx-driver-watch", daemon=True).start()
    _watching = True
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send sig to this process the moment its parent dies (Linux
    PR_SET_PDEATHSIG); False where it cannot. A parent already gone is not noticed here: the
    caller compares os.getppid() with the parent it expects."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig)) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def commit_guard():
    """The check an engine process's writer runs before each commit, made when its run opens:
    the driver is alive, and so is this process's parent (for a tensor-parallel worker, the
    engine core: a worker orphaned by its core's death must not commit either). The kernel also
    kills this process the moment its parent dies, so no commit can start in between."""
    parent = os.getppid()
    die_with_parent()

    def check() -> None:
        require_driver()
        if os.getppid() != parent:
            os._exit(1)

    return check


class Reaper:
    """The driver's handle on its watcher."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls) -> Reaper:
        mark_driver()
        proc = subprocess.Popen([sys.executable, "-m", "vx.engine.lifetime.reaper", str(os.getpid())], stdin=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
        return cls(proc)

    def stop(self) -> None:
        """The engine was shut down normally: the watcher leaves without killing anything."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"ok\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    watch(int(sys.argv[1]))
