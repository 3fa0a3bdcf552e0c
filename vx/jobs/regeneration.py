"""The one-pass job's regeneration: `vx regenerate` in a child process of `vx extract --regenerate`
(vx/jobs/one_pass.py), and what the driver says to it and hears from it.

On its stdin: a JSON line of the settings the driver worked out while the child imported vLLM
(LATER: max_model_len, and on a GPU its share of --gpu-memory-utilization), then "go" when the driver holds it (CPU: the generation starts once the capture's
engine has; a kept child: the capture's engine has started, so its own engine may stop), then its
end (a held child stops its engine once the capture is done: CPU, where the capture follows the
generation's end and would share the cores with that stop). On its
stdout, JSON events: "ready" (its engine started), "committed" (every conversation fsynced; its
engine may still be stopping), "summary".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from vx.device import cuda_available
from vx.engine.lifetime.fast_exit import in_spawned_child
from vx.errors import VxError

in_spawned_child()  # the regeneration's engine core and worker import this module first: their quick exit

STOP_S = 5.0      # the regeneration's process group gets this long after SIGTERM, then SIGKILL
LATER = "stdin"   # a setting the driver works out while the child starts (send_later)


class Regeneration:
    """The child process that regenerates into OUT/regenerated.jsonl (its own process group, dying
    with this process); finished() for the following input: True once it exited 0, raising if it failed."""

    def __init__(self, conf: dict, env: dict[str, str], log: Path, hold: bool = False, keep: bool = False):
        self.log = log
        full = dict(os.environ, **env, VX_PARENT_PID=str(os.getpid()))
        # hold: its engine started, it waits for release(); keep: it generates at once, but its engine
        # stops only after release() (the capture's engine has started) or done()
        conf = dict(conf, hold=hold, keep=keep)
        if not conf["max_model_len"]:
            conf["max_model_len"] = LATER  # sent by send_max_model_len(), while the child imports
        # its own process group (stop() signals it whole; a terminal's Ctrl-C reaches this process only)
        # but this process's session: Linux schedules each session as one group (autogroup), and two
        # engines whose OpenMP threads share cores from two sessions starve each other's bound thread
        # for seconds (CPU: the regeneration's weights loaded in 2.4 s beside vx's start, 0.15 s alone)
        with open(log, "a") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "vx.jobs.regeneration", json.dumps(conf)],
                                         env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, process_group=0)
        self.summary: dict | None = None
        self.released = False  # "go" said
        self.committed = threading.Event()  # every conversation committed (the child's engine may still be stopping)
        self.ready = threading.Event()  # its engine started
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send_later(self, settings: dict) -> None:
        """The values of the settings started as LATER, in one line."""
        self._say(json.dumps(settings) + "\n")

    def release(self) -> None:
        """A held child generates (idempotent)."""
        if not self.released:
            self.released = True
            self._say("go\n")

    def done(self) -> None:
        """Its stdin closes: nothing more is said (a held child stops its engine once it has
        committed every conversation and read this; a released one waits for nothing)."""
        self.release()
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def _say(self, line: str) -> None:
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # it already stopped: finished() says why

    def wait_ready(self) -> None:
        """Until its engine has started, or it is done (raising if it failed: nothing left to do is no failure)."""
        while not (self.ready.wait(0.1) or self.finished()):
            pass

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("vx") == "committed":
                self.committed.set()
            elif rec.get("vx") == "ready":
                self.ready.set()
            elif rec.get("vx") == "summary":
                self.summary = rec.get("summary")

    def finished(self) -> bool:
        """True once every conversation is committed (its engine may still be stopping), raising if
        the child failed before that."""
        if self.committed.is_set():
            return True
        if self.proc.poll() is None:
            return False
        self.wait()
        return True

    def wait(self, timeout: float = 60.0) -> None:
        """The child's exit (its engine stopped, its summary read); raises if it failed."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise VxError(f"the regeneration did not exit {timeout:.0f} s after its last commit; see {self.log}")
        if rc != 0:
            from vx.launch.workers import last_line

            why = last_line(self.log).removeprefix("vx: error: ") or f"see {self.log}"
            raise VxError(f"the regeneration stopped (exit {rc}): {why}")
        self._reader.join(5.0)

    def stop(self) -> None:
        """Its whole process group (its engine included): SIGTERM, then SIGKILL after STOP_S."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def before_stop(hold: bool, keep: bool, stdin):
    """What the regeneration's engine waits for once every conversation is committed, before it
    stops. held (CPU): the capture's end (stdin closed), so its stop's work (~2 s of a core) never
    slows the capture's threads. keep (the capture's engine starting beside the generation, as on
    a GPU): the capture's engine started ("go", or stdin closed), since vLLM fails an engine whose
    free device memory rises while it profiles (0.33 gpu_worker.determine_available_memory:
    "Error in memory profiling"), which this engine's stop would cause."""
    if hold:
        return stdin.read
    if keep:
        def until_started():
            for line in stdin:
                if line.strip() == "go":
                    return
        return until_started
    return None


def cpu_layout() -> tuple[tuple[list[int], list[int]] | None, bool]:
    """(the regeneration's cores and the capture's, or None for every core to both; whether the
    capture waits for the regeneration's end). GPU: shared device, following. CPU: every core to
    both, capture after. VX_ONE_PASS_CORES=split (bench/one_pass.py): the cores halved and the
    capture following, the layout measured against it."""
    if cuda_available():
        return None, False
    if os.environ.get("VX_ONE_PASS_CORES") != "split":
        return None, True
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return (cores[:half], cores[half:] or cores), False


def reversed_binding(tensor_parallel_size: int) -> dict[str, str]:
    """The regeneration engine's OpenMP binding when both engines start at once on every core: the
    cores in reverse order. vLLM's CPU worker binds its main thread to the first core of its list
    (GOMP_CPU_AFFINITY for the libgomp it preloads) and sorts any list it is given, so two engines
    starting together import, load and profile on one core while the other idles (bench/one_pass.py
    timelines: ~5 core-s in 5 s). vLLM's "nobind" leaves the binding to GOMP_CPU_AFFINITY, which
    vx/engine/generator.py sets for its engine's start only (ENGINE_GOMP): the worker's main thread
    on the last core, its generation on every core. Left alone: a binding the user chose, and
    tensor parallelism (vx/device.py splits the cores)."""
    from vx.engine.generator import ENGINE_GOMP

    if tensor_parallel_size > 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return {}
    cores = sorted(os.sched_getaffinity(0), reverse=True)
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", ENGINE_GOMP: " ".join(map(str, cores)),
            "OMP_NUM_THREADS": str(len(cores))}


def pin_env(cores: list[int]) -> dict[str, str]:
    c = ",".join(map(str, cores))
    return {"VX_CPU_CORES": c, "OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": c}


def main(argv: list[str]) -> int:
    """The regeneration's process: `python -m vx.jobs.regeneration REGEN_CONFIG_JSON`, run as a
    partition worker runs (dies with its launcher, keeps to its cores, JSON events on stdout)."""
    from vx.launch.workers import run_partition_worker
    from vx.jobs.config import RegenConfig
    from vx.jobs.regenerate import run_regenerate

    def run(d: dict, events):
        hold, keep = d.pop("hold", False), d.pop("keep", False)
        if LATER in d.values():  # import the engine's modules while the driver plans, then ask
            from vx.engine.generator import preload

            preload(d["tensor_parallel_size"], Path(d["output"]))
            line = sys.stdin.readline()
            if not line.strip():
                raise VxError("the one-pass driver stopped before the regeneration could start")
            d = dict(d, **json.loads(line))

        def ready():  # the engine started: the driver may start its own; held, wait for its word
            events.emit("ready")
            if hold and sys.stdin.readline().strip() != "go":
                raise VxError("the one-pass driver stopped before the generation could start")

        return run_regenerate(RegenConfig(**d), reporter=events, ready=ready,
                              before_stop=before_stop(hold, keep, sys.stdin))

    return run_partition_worker(argv, run)


if __name__ == "__main__":
    from vx.errors import leave

    leave(main(sys.argv[1:]))
