"""The vLLM engine lives and dies with its driver, and only one live process writes an output.

One output goes through every way a run ends early, then one rerun finishes it exactly once:
- the driver killed with SIGKILL mid-run: within seconds no process of that run is left (found
  by the VX_DRIVER mark every engine process inherits, read from /proc), nothing was committed
  after the driver died;
- SIGTERM (preemption) of the driver alone: a clean stop like Ctrl-C (exit 143, one line, no
  traceback), no process left;
- the engine core killed under a live driver, with SIGKILL (the OOM killer's choice: the largest
  process) in warm-up and mid-run: the driver is gone within 10 s of the engine's death with one
  line naming it and exit code 3, nothing committed after the death, no process left;
- SIGTERM to the engine core alone, mid-run: one line, exit code 3, within seconds;
- SIGTERM to the whole process group (`scancel`, `timeout`, `kill -- -PGID`): exit 143 within 10 s.
A directory that a live process still writes into is refused at once, untouched.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vx
from conftest import ROOT, machine_cache
from vx.engine.lifetime.liveness import STOPPING_S

import procfs  # noqa: E402

CHAT = str(ROOT / "examples" / "chat.jsonl")
ALL_IDS = sorted(json.loads(line).get("id") for line in open(CHAT))
BOUND_S = 10.0  # a driver outlives its dead engine by less than this
DIED = re.compile(r"^vx: error: the vLLM engine \(pid (\d+)\) died: killed by SIGKILL \(out of memory\?\); "
                  r"committed (samples|conversations) are kept, rerun the same command to continue$")
# the core's shutdown: its refusal, its exit, or its worker's exit, whichever the driver meets first
STOPPED = re.compile(r"^vx: error: the vLLM engine(('s worker process)? \(pid \d+\) died( as it started)?(: .+)?| is shutting down "
                     r"\(something other than vx stopped it\)); committed samples are kept, rerun the same command "
                     r"to continue$")


def start(out: Path, cache: Path, fault: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vx", "extract", CHAT, "-o", str(out), "--backend", "vllm", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "256", "--shard-size", "0.5", "--json"]
    return launch(cmd, cache, fault)


def launch(cmd: list[str], cache: Path, fault: str | None = None) -> subprocess.Popen:
    """In a session of its own, as a job script or scheduler starts it (so its group can be signalled)."""
    env = dict(os.environ, VX_CACHE_DIR=machine_cache(cache))
    env.pop("VX_FAULT", None)
    if fault:
        env["VX_FAULT"] = fault
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)


def wait_gone(driver_pid: int, within_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while procfs.processes_of(driver_pid):
        assert time.monotonic() - t0 < within_s, f"left running: {procfs.processes_of(driver_pid)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def engine_cores(driver: int) -> list[int]:
    return [pid for pid in procfs.processes_of(driver) if procfs.cmdline(pid).startswith(b"VLLM::EngineCore")]


def follow(p: subprocess.Popen, until=lambda: False, act=None) -> tuple[float, float | None, str]:
    """Watch the driver every 50 ms: once until() holds, act(engine pid) is done (a kill). Returns
    (when the driver exited, when its engine core was last seen alive, stderr)."""
    seen: set[int] = set()
    last_alive = None
    acted = False
    while p.poll() is None:
        alive = engine_cores(p.pid)
        if alive:
            seen.update(alive)
            last_alive = time.monotonic()
        if act and not acted and alive and until():
            act(alive[0])
            acted = True
        time.sleep(0.05)
    exited = time.monotonic()
    assert seen, "the engine core was never seen"
    _, stderr = p.communicate(timeout=60)
    return exited, last_alive, stderr


def assert_one_line(stderr: str, pattern=DIED) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    assert pattern.match(stderr.strip().splitlines()[-1]), stderr[-3000:]


def kill9_and_wait(pid: int, writer_in_worker: bool = True) -> dict:
    """SIGKILL of an engine core, then the moment it and its vLLM workers (separate processes on
    CPU; the capture writer runs in one) are really gone (a syscall in flight, an fsync, ends
    first): (when in time_ns, when in monotonic). Where vx's writer runs in a worker, the workers
    must die with their core (wait_gone bounds every other process of the run)."""
    workers = [w for w in procfs.children(pid) if procfs.cmdline(w).startswith(b"VLLM::Worker")]
    workers = workers if writer_in_worker else []
    os.kill(pid, signal.SIGKILL)
    while procfs.alive(pid):
        time.sleep(0.002)
    t_core = time.monotonic()
    while any(procfs.alive(w) for w in workers):
        assert time.monotonic() - t_core < 5.0, f"vLLM workers {workers} outlived their engine core"
        time.sleep(0.002)
    return {"pid": pid, "ns": time.time_ns(), "t": time.monotonic()}


def committed(manifest: Path) -> int:
    return sum(1 for _ in open(manifest)) if manifest.exists() else 0


def rerun_gives_every_sample_once(out: Path, cache: Path) -> None:
    again = start(out, cache)
    stdout, stderr = again.communicate(timeout=900)
    assert again.returncode == 0, stderr[-3000:]
    ids = [sid for r in map(json.loads, open(out / "manifest.jsonl")) for sid in r["sample_ids"]]
    assert sorted(ids) == ALL_IDS, "lost or duplicated samples"
    assert len(vx.open_dataset(out)) == len(ALL_IDS)


def test_a_run_killed_or_stopped_every_way_leaves_no_process_and_one_rerun_gives_every_sample_once(tmp_path,
                                                                                                   tiny_model):
    """Both ways a driver dies, then three ways its engine dies, one after the other on one
    output; one rerun then finishes it."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    manifest = out / "manifest.jsonl"

    # SIGKILL (OOM killer, kill -9): the driver SIGKILLs itself at its 40th engine step
    p = start(out, cache, fault="after-step:40")
    seen_alive = []
    while p.poll() is None:
        seen_alive = procfs.processes_of(p.pid) or seen_alive
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
    engine = procfs.processes_of(p.pid)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 143, stderr[-3000:]
    assert "interrupted; rerun the same command" in stderr and "Traceback" not in stderr
    assert engine and wait_gone(p.pid) < 10
    engine_deaths(out, cache)
    rerun_gives_every_sample_once(out, cache)


def engine_deaths(out: Path, cache: Path) -> None:
    """The engine core dies under a live driver, four ways, on the output of the runs above."""
    manifest = out / "manifest.jsonl"
    # SIGKILL of the engine core at its first step: the warm-up's, before any sample
    p = start(out, cache, fault="engine-step:1")
    exited, last_alive, stderr = follow(p)
    assert p.returncode == 3, stderr[-3000:]
    assert_one_line(stderr)
    assert exited - last_alive < BOUND_S, f"the driver outlived its engine by {exited - last_alive:.1f} s"
    before = committed(manifest)
    wait_gone(p.pid)

    # SIGKILL of the engine core from outside, mid-run, once it committed a shard
    p = start(out, cache)
    killed = {}

    def kill9(pid):
        killed.update(kill9_and_wait(pid))

    exited, _, stderr = follow(p, until=lambda: committed(manifest) > before, act=kill9)
    assert p.returncode == 3, stderr[-3000:]
    assert_one_line(stderr)
    assert f"(pid {killed['pid']})" in stderr
    took = exited - killed["t"]
    print(f"driver gone {took:.2f} s after its engine's SIGKILL")
    assert took < BOUND_S
    wait_gone(p.pid)
    assert manifest.stat().st_mtime_ns <= killed["ns"], "committed after the engine died"
    done = committed(manifest)
    assert done < len(ALL_IDS)

    # SIGTERM to the engine core alone (a container stop, an admin), once a further shard is
    # committed: vLLM's core refuses every call as it shuts down, then exits (the fault campaign's
    # trial 48 of seed 43 found that refusal printed as a traceback, exit 1)
    p = start(out, cache)
    sent = {}

    def term_core(pid):
        os.kill(pid, signal.SIGTERM)
        sent["t"] = time.monotonic()

    exited, _, stderr = follow(p, until=lambda: committed(manifest) > done, act=term_core)
    assert p.returncode == 3, stderr[-3000:]
    assert_one_line(stderr, STOPPED)
    assert exited - sent["t"] < BOUND_S + STOPPING_S
    wait_gone(p.pid)
    done = committed(manifest)
    assert done < len(ALL_IDS)

    # SIGTERM to the whole process group (driver, engine core), once a further shard is committed
    p = start(out, cache)

    def term_group(pid):
        os.killpg(p.pid, signal.SIGTERM)
        sent["t"] = time.monotonic()

    exited, _, stderr = follow(p, until=lambda: committed(manifest) > done, act=term_group)
    assert p.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == (
        "vx: interrupted; rerun the same command to continue"), stderr[-3000:]
    assert exited - sent["t"] < BOUND_S
    wait_gone(p.pid)


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


def test_a_signal_as_the_command_starts_is_the_documented_exit_and_one_line(tmp_path):
    """A scheduler's kill as the job starts (the fault campaign's trial 184 of seed 45: SIGTERM at
    once gave exit -15 and nothing on stderr): from the moment `vx` has taken the signals, the
    first thing it does, while it loads its modules, it ends with 143 (SIGTERM) or 130 (SIGINT)
    and one line, no traceback, nothing written."""
    # the signals are vx's before the command line's modules start loading
    probe = ("import builtins, signal, sys, vx.__main__ as m\n"
             "load = builtins.__import__\n"
             "def spy(name, *a, **k):\n"
             "    if name == 'vx.cli':\n"
             "        print(all(signal.getsignal(s) is m._before_start for s in (signal.SIGINT, signal.SIGTERM)))\n"
             "        sys.exit(0)\n"
             "    return load(name, *a, **k)\n"
             "builtins.__import__ = spy\n"
             "m.run()\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.strip() == "True", r.stdout + r.stderr[-2000:]
    for sig, code in [(signal.SIGTERM, 143), (signal.SIGINT, 130)]:
        out = tmp_path / f"out-{sig}"
        p = subprocess.Popen([sys.executable, "-m", "vx", "extract", CHAT, "-o", str(out), "--backend", "hf"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        while not procfs.catches(p.pid, signal.SIGTERM):  # vx takes SIGTERM last (Python takes SIGINT at start)
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.001)
        os.killpg(p.pid, sig)
        stderr = procfs.stderr_within(p, f"signal {sig} to its group")
        assert p.returncode == code, (sig, p.returncode, stderr[-2000:])
        assert stderr.strip().splitlines() == ["vx: interrupted; rerun the same command to continue"], stderr[-2000:]
        assert not out.exists()


def test_a_stop_that_a_finalizer_swallowed_still_stops_the_loop_at_its_next_turn():
    """The fault campaign's trial 86 of seed 51: SIGINT to a --dp 2 launcher landed while the
    garbage collector ran a library's `__del__`; Python prints what a finalizer raises as
    "Exception ignored" with a traceback and goes on, and the run went on to exit 0. Every main
    loop of vx (the launcher's, the hf batches, the vLLM steps, vx regenerate's) checks for a stop
    at each turn, and the stop is said in one line."""
    script = ("import os, signal, sys, time\n"
              "from vx.errors import raise_if_stopped, run_guarded\n"
              "class Finalized:\n"
              "    def __del__(self):  # the handler's KeyboardInterrupt is raised here, and ignored\n"
              "        os.kill(os.getpid(), signal.SIGINT)\n"
              "        time.sleep(1)\n"
              "def body():\n"
              "    Finalized()\n"
              "    print('went on', flush=True)\n"
              "    raise_if_stopped()  # a loop's turn\n"
              "    print('not stopped', flush=True)\n"
              "    return 0\n"
              "sys.exit(run_guarded(body))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.splitlines() == ["went on"], r.stdout + r.stderr[-2000:]
    assert r.returncode == 130 and r.stderr.strip().splitlines() == [
        "vx: interrupted; rerun the same command to continue"], r.stderr[-2000:]  # one line, no traceback


def test_sigint_to_the_engine_core_alone_as_it_finishes_starting_ends_the_driver_with_one_line(tmp_path, tiny_model):
    """The fault campaign's seed 66, trial 136: SIGINT to the engine core alone (an admin, a
    container runtime) once it had done its start. The core shuts down and exits 0; vLLM's client,
    past its handshake, then waits on its next call (`reset_mm_cache`, still inside `LLM()`) for
    ever, and the driver took a core that exits during the start for a start that fails, whose
    error vLLM raises itself. Now the driver leaves with exit 3 and one line."""
    out = tmp_path / "out"
    p = start(out, tmp_path / "cache")
    log = out / "logs" / "vllm.log"
    deadline = time.monotonic() + 900  # engines start on a loaded machine: wait for the event
    while p.poll() is None and time.monotonic() < deadline and not (
            log.exists() and "init engine (profile, create kv cache, warmup model) took" in log.read_text()):
        time.sleep(0.02)
    cores = engine_cores(p.pid)
    assert p.poll() is None and cores, p.communicate()[1][-3000:]
    os.kill(cores[0], signal.SIGINT)
    sent = time.monotonic()
    stderr = procfs.stderr_within(p, "SIGINT to the engine core")
    assert p.returncode == 3, stderr[-3000:]
    assert_one_line(stderr, STOPPED)
    print(f"driver gone {time.monotonic() - sent:.1f} s after SIGINT to its engine core: {stderr.splitlines()[-1]}")
    wait_gone(p.pid)


@pytest.mark.parametrize("to", ["driver", "group"])
def test_ctrl_c_while_the_engine_starts_ends_the_run_in_seconds_not_when_the_start_is_done(tmp_path, tiny_model, to):
    """The fault campaign's seed 54 (trials 14, 16: a signal as the one-pass capture engine started,
    no exit within 60 s on a loaded machine). vLLM catches the KeyboardInterrupt in its handshake and
    goes on waiting for the engine's ready message; vx used to act on the stop only once the start
    was over. Now the driver leaves a few seconds after the stop, the engine's processes killed:
    before the engine finished starting (its log never says so), with the one line on the terminal.
    To the group, as Ctrl-C in a terminal sends it (seed 65, trial 25): the engine's core ends its
    start on the signal too, and vLLM, its own wait for the core broken by the stop, waited on a
    socket nothing answers."""
    out = tmp_path / "out"
    tag = f"VX_TEST_RUN={tmp_path.name}-{time.monotonic_ns()}"
    p = subprocess.Popen([sys.executable, "-m", "vx", "extract", "examples/chat.jsonl", "-o", str(out), "--backend",
                          "vllm"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, **dict([tag.split("=", 1)])))
    deadline = time.monotonic() + 900  # the engine's process appears once the driver has loaded: wait for it
    while p.poll() is None and time.monotonic() < deadline and not any(
            procfs.cmdline(c).startswith(b"VLLM::EngineCore") for c in procfs.children(p.pid)):
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1][-3000:]
    time.sleep(1.0)  # into the start: the core is importing vLLM, the driver waits in vLLM's handshake
    (os.killpg if to == "group" else os.kill)(p.pid, signal.SIGINT)
    stderr = procfs.stderr_within(p, "Ctrl-C during the engine's start")
    assert p.returncode == 130 and stderr.strip().splitlines()[-1] == \
        "vx: interrupted; rerun the same command to continue", stderr[-3000:]
    log = (out / "logs" / "vllm.log").read_text(errors="replace")
    assert "init engine (profile, create kv cache, warmup model) took" not in log  # it left during the start
    sent = time.monotonic()
    while procfs.tagged(tag.encode()):
        assert time.monotonic() - sent < 30, f"left running: {procfs.tagged(tag.encode())}"
        time.sleep(0.2)


SPAWNS = '''
import multiprocessing, sys
{entry}

def child(q):
    import vx.engine.lifetime.fast_exit as quick
    q.put(quick._installed)

if __name__ == "__main__":
    import vx.engine.lifetime.fast_exit as quick
    ctx = multiprocessing.get_context("spawn")  # how vLLM starts its engine core and worker on CPU
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(quick._installed, q.get())
    p.join()
'''


def test_processes_spawned_from_a_vx_command_exit_without_the_final_collection_and_the_command_keeps_its_own(
        tmp_path):
    """A regeneration's engine core has no vx code of its own; Python imports the parent's main
    module first in a spawned process, so a vx command's main module installs the quick exit
    there (vx/engine/lifetime/fast_exit.py), and only there. As the `vx` script (a path) and as `python -m`
    (a module) run it."""
    (tmp_path / "as_script.py").write_text(SPAWNS.format(entry="from vx.__main__ import run  # the vx script"))
    (tmp_path / "as_module.py").write_text(SPAWNS.format(entry="import vx.jobs.regeneration  # -m vx.jobs.regeneration"))
    for run in ([sys.executable, str(tmp_path / "as_script.py")], [sys.executable, "-m", "as_module"]):
        r = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)])))
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == ["False", "True"], (run, r.stdout)  # the command: no; its spawned child: yes


STARTS = '''
import gc, multiprocessing


def child(q):
    import vx.engine.lifetime.fast_exit as quick
    before = gc.isenabled()
    from importlib.metadata import entry_points
    for plugin in entry_points(group="vllm.general_plugins"):  # what vLLM's load_general_plugins does
        if plugin.name == "vx":
            plugin.load()()
    q.put((multiprocessing.current_process().name, before, gc.isenabled(), quick._installed))


def spawn():  # as vLLM starts its engine core and workers on CPU
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    for name in ("EngineCore", "VllmWorker-1", None):
        p = ctx.Process(target=child, args=(q,), name=name)
        p.start()
        print(*q.get())
        p.join()
'''

AS_SCRIPT = '''
from vx.__main__ import run  # what the vx script is

if __name__ == "__main__":
    from starts import spawn
    spawn()
'''

AS_MODULE = '''
import runpy, sys
import vx.cli
from starts import spawn

vx.cli.entry = spawn  # the command: it spawns
sys.argv = ["vx"]
runpy.run_module("vx", run_name="__main__", alter_sys=True)  # what python -m vx does
'''


def test_vllms_engine_processes_spawned_from_a_vx_command_import_with_the_collector_off_until_vllm_loads_plugins(
        tmp_path):
    """vLLM's engine core and workers (by the names vLLM gives them) import torch, transformers and
    vLLM with the garbage collector off, as a vx command does, and have it back once vLLM loads its
    general plugins in them (vx's entry point, after those imports); any other process a vx command
    spawns keeps its collector as Python starts it. Each has the quick exit. From the `vx` script and
    from `python -m vx` alike (multiprocessing skips a main module named *.__main__ in its children)."""
    (tmp_path / "starts.py").write_text(STARTS)
    (tmp_path / "as_script.py").write_text(AS_SCRIPT)
    (tmp_path / "as_module.py").write_text(AS_MODULE)
    for script in ("as_script.py", "as_module.py"):
        r = subprocess.run([sys.executable, str(tmp_path / script)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)])))
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split("\n")[:3] == ["EngineCore False True True", "VllmWorker-1 False True True",
                                            "SpawnProcess-3 True True True"], (script, r.stdout)
