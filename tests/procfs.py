"""What /proc says about a process, for the checks that processes end with their driver (the
fault campaign, tests/test_engine_lifetime.py). Every reader returns a neutral value for a
process that is gone: they race with exits by design."""

from __future__ import annotations

import os
from pathlib import Path


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def cmdline(pid: int) -> bytes:
    """The command line (vLLM renames its processes: b"VLLM::EngineCore", b"VLLM::Worker...")."""
    return _read(pid, "cmdline")


def environ(pid: int) -> bytes:
    return _read(pid, "environ")


def _stat(pid: int) -> list[str]:
    raw = _read(pid, "stat").decode(errors="replace")
    return raw.rsplit(")", 1)[1].split() if ")" in raw else []


def parent(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else -1


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie waiting for its parent."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def children(pid: int) -> list[int]:
    return [p for p in pids() if parent(p) == pid]


def descendants(pid: int) -> list[int]:
    """pid and every process under it, found by parent (an engine core's environ is its title's)."""
    tree, i = [pid], 0
    while i < len(tree):
        tree += children(tree[i])
        i += 1
    return tree


def processes_of(driver_pid: int) -> list[int]:
    """Live processes a driver started: they carry VX_DRIVER=<pid>:... in their environment."""
    mark = f"VX_DRIVER={driver_pid}:".encode()
    return [p for p in pids() if any(item.startswith(mark) for item in environ(p).split(b"\0")) and alive(p)]


def tagged(item: bytes) -> list[int]:
    """Live processes whose environment holds item (b"NAME=value"), set by whoever started the
    first of them: every descendant inherits it, whichever process of vx marks what (a --dp
    launcher's partition workers and their engines carry no VX_DRIVER of the launcher's)."""
    return [p for p in pids() if item in environ(p).split(b"\0") and alive(p)]


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for sig now (the SigCgt mask of /proc/PID/status)."""
    for line in _read(pid, "status").decode(errors="replace").splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def stderr_within(p, what: str, within_s: float = 60.0) -> str:
    """A signalled driver's stderr once it exited, within_s after what happened to it (a
    subprocess.Popen started in a session of its own); else its group is killed and the check
    fails saying what it did not end after."""
    import signal
    import subprocess

    try:
        return p.communicate(timeout=within_s)[1]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"no exit within {within_s:.0f} s of {what}")
