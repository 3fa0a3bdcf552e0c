"""The vLLM engine lives and dies with its driver, and only one live process writes an output.

- Driver killed with SIGKILL mid-run: within seconds no process of that run is left (found by
  the VX_DRIVER mark every engine process inherits, read from /proc), nothing was committed after
  the driver died.
- SIGTERM (preemption) of the next run on that output: a clean stop like Ctrl-C (exit 143, one
  line, no traceback), no process left; rerunning the same command then gives every sample
  exactly once.
- A directory that a live process still writes into is refused at once, untouched.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import vx
from conftest import ROOT, machine_cache

CHAT = str(ROOT / "examples" / "chat.jsonl")
ALL_IDS = sorted(json.loads(line).get("id") for line in open(CHAT))


def start(out: Path, cache: Path, fault: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, VX_CACHE_DIR=machine_cache(cache))
    if fault:
        env["VX_FAULT"] = fault
    cmd = [sys.executable, "-m", "vx", "extract", CHAT, "-o", str(out), "--backend", "vllm", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "256", "--shard-size", "0.5", "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def processes_of(driver_pid: int) -> list[int]:
    """Live processes started by this driver: they carry VX_DRIVER=<pid>:... in their environment."""
    mark = f"VX_DRIVER={driver_pid}:".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(item.startswith(mark) for item in env.split(b"\0")):
            found.append(int(entry))
    return found


def wait_gone(driver_pid: int, within_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while processes_of(driver_pid):
        assert time.monotonic() - t0 < within_s, f"left running: {processes_of(driver_pid)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def rerun_gives_every_sample_once(out: Path, cache: Path) -> None:
    again = start(out, cache)
    stdout, stderr = again.communicate(timeout=900)
    assert again.returncode == 0, stderr[-3000:]
    ids = [sid for r in map(json.loads, open(out / "manifest.jsonl")) for sid in r["sample_ids"]]
    assert sorted(ids) == ALL_IDS, "lost or duplicated samples"
    assert len(vx.open_dataset(out)) == len(ALL_IDS)


def test_sigkill_then_sigterm_mid_run_leave_no_process_and_the_rerun_gives_every_sample_once(tmp_path, tiny_model):
    """Both ways a driver dies, one after the other on one output; one rerun then finishes it."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    manifest = out / "manifest.jsonl"

    # SIGKILL (OOM killer, kill -9): the driver SIGKILLs itself at its 40th engine step
    p = start(out, cache, fault="after-step:40")
    seen_alive = []
    while p.poll() is None:
        seen_alive = processes_of(p.pid) or seen_alive
        time.sleep(0.2)
    dead_ns = time.time_ns()
    assert p.returncode == -9, p.stderr.read()[-3000:]
    assert seen_alive, "the engine's processes were never seen"
    took = wait_gone(p.pid)
    print(f"engine processes {seen_alive} gone {took:.2f} s after the driver")
    assert not manifest.exists() or manifest.stat().st_mtime_ns <= dead_ns, "committed after the driver died"
    committed = sum(1 for _ in open(manifest)) if manifest.exists() else 0
    assert committed < len(ALL_IDS)  # it really died mid-run

    # SIGTERM (preemption) of the next run, once it committed a shard of its own: a clean stop like Ctrl-C
    p = start(out, cache)
    while not (manifest.exists() and sum(1 for _ in open(manifest)) > committed):
        assert p.poll() is None, p.stderr.read()[-3000:]
        time.sleep(0.1)
    engine = processes_of(p.pid)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 143, stderr[-3000:]
    assert "interrupted; rerun the same command" in stderr and "Traceback" not in stderr
    assert engine and wait_gone(p.pid) < 10
    rerun_gives_every_sample_once(out, cache)


def test_an_output_a_live_process_still_writes_is_refused_untouched(tmp_path, tiny_model):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from vx.store.writer import ShardWriter; "
         f"w = ShardWriter({str(out)!r}, {{}}, 10**6, 0, 5, 256, 'bf16'); print('ready', flush=True); "
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        stray = out / ".shard-00000.safetensors.tmp"  # what a live writer may be writing right now
        stray.write_bytes(b"partial")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "vx", "extract", CHAT, "-o", str(out), "--backend", "hf"],
                           capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
        assert r.returncode == 2, r.stderr
        assert f"pid {holder.pid}" in r.stderr and "still being written" in r.stderr
        assert stray.exists() and time.monotonic() - t0 < 60
    finally:
        holder.kill()
        holder.wait()
