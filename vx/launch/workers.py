"""Partition workers on this node: engine slots (GPU groups, or on CPU a share of the cores),
worker processes started in their own session and reaped with their whole process group, their
JSON progress events folded into one bar, and the body every worker process runs
(vx/launch/worker.py). The launcher (vx/launch/launcher.py) runs every job through them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from vx.errors import VxError, imports_over, raise_if_stopped, startup_over
from vx.monitor.progress import RunProgress

GROUP_EXIT_S = 30.0  # a finished worker's engine processes get this long after SIGTERM, then SIGKILL


def worker_slots(cfg) -> list[dict[str, str]]:
    """The environment of each engine slot: its GPUs, or on a CPU machine its share of the cores."""
    n, tp = cfg.data_parallel_size, cfg.tensor_parallel_size
    from vx.device import gpu_groups

    ids = gpu_groups(cfg.gpus, n * tp)
    if ids is not None:
        return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[k * tp:(k + 1) * tp])} for k in range(n)]
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)  # more engines than cores: they share (slower, still correct)
    slots = []
    for k in range(n):
        group = [cores[(k * per + j) % len(cores)] for j in range(per)]
        ranks = [group[r * len(group) // tp:(r + 1) * len(group) // tp] or group for r in range(tp)]
        slots.append({"VX_CPU_CORES": ",".join(map(str, group)), "OMP_NUM_THREADS": str(len(group)),
                      "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)})
    return slots


def worker_command(config: dict, job: str) -> list[str]:
    return [sys.executable, "-m", "vx.launch.worker", job, json.dumps(config)]


def spawn_worker(config: dict, extra_env: dict, log: Path, on_event,
                 job: str) -> tuple[subprocess.Popen, threading.Thread]:
    """Start one partition's worker (`python -m vx.launch.worker JOB CONFIG`): its own session (its
    vLLM engine processes go with it), stderr appended to `log`, each JSON event of its stdout
    handed to on_event(rec) by a reader thread."""
    env = dict(os.environ, **extra_env, VX_PARTITION=str(config["partition_index"]),
               VX_PARENT_PID=str(os.getpid()))
    with open(log, "a") as err:
        proc = subprocess.Popen(worker_command(config, job), env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    reader = threading.Thread(target=read_events, args=(proc.stdout, on_event), daemon=True)
    reader.start()
    return proc, reader


def reap_worker(proc: subprocess.Popen, reader: threading.Thread, kill: bool = False,
                wait_s: float = GROUP_EXIT_S) -> None:
    """After a worker exits (or to stop it): its process group goes first, since its engine
    processes hold its stdout open, then its last lines are read. Returns once no process of the
    group is left (SIGKILL after wait_s), so the slot's GPUs are free before the next worker's
    memory check."""
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill or proc.returncode else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    if kill:
        proc.wait()
    deadline = time.monotonic() + wait_s
    while group_alive(proc.pid):
        if time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + wait_s
        time.sleep(0.05)
    reader.join(timeout=30)


def stop_worker(proc: subprocess.Popen, reader: threading.Thread) -> None:
    """Stop a running worker as Ctrl-C stops a run (SIGTERM: its committed shards kept, its engine
    stopped); SIGKILL to its group if it has not ended after GROUP_EXIT_S. Returns once it is reaped."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=GROUP_EXIT_S)
    except subprocess.TimeoutExpired:
        pass
    reap_worker(proc, reader, kill=proc.poll() is None)


def read_events(stream, on_event) -> None:
    """A worker's stdout: JSON progress/summary lines (anything else is passed to stderr)."""
    for line in stream:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and "vx" in rec:
            on_event(rec)
        elif line.strip():
            print(line.rstrip(), file=sys.stderr)


class Tally:
    """Progress of every partition (latest counts per worker attempt) folded into one bar; each
    worker's own figures go to the bar's per-partition rows and to the metrics server, if any."""

    def __init__(self, bar: RunProgress, metrics=None):
        self.bar, self.metrics, self.seen, self.shown = bar, metrics, {}, (0, 0, 0)

    def update(self, key, rec: dict) -> None:
        if rec.get("vx") == "progress" and "samples_per_s" in rec:
            part = rec.get("partition", key)
            self.bar.partition(part, rec)
            if self.metrics is not None:
                self.metrics.update(rec)
        self.seen[key] = (rec["samples"], rec["tokens"], rec["skipped"])
        s, t, k = (sum(v[i] for v in self.seen.values()) for i in range(3))
        ds, dt, dk = s - self.shown[0], t - self.shown[1], k - self.shown[2]
        if ds > 0:
            self.bar.advance(ds, dt, 0)
        if dk > 0:
            self.bar.skip(dk)
        self.shown = (max(s, self.shown[0]), max(t, self.shown[1]), max(k, self.shown[2]))


def run_workers(count: int, slots: list[dict], start, tally: Tally,
                stop_others: str | None = None) -> tuple[dict[int, dict], dict[int, str]]:
    """Keep every slot busy with the next of `count` partitions until all ran. start(index,
    slot_env, events) spawns one worker and returns (proc, index, start time, log, reader); its
    events go to `events` as (index, rec). Returns (summary and timing of each partition that
    finished, reason of each that failed); on an exception every running worker is killed.
    A failed partition leaves the others to finish their work, unless stop_others (why) is given:
    then they are stopped as Ctrl-C stops a run (committed work kept) and none is started."""
    imports_over()  # this process loads no engine: its start-up (imports, the plan) is over
    startup_over()
    events: queue.Queue = queue.Queue()
    todo = list(range(count))
    running: dict[int, tuple] = {}  # slot -> (proc, partition, start, log, stdout reader)
    results: dict[int, dict] = {}
    failed: dict[int, str] = {}
    t_start = time.perf_counter()
    try:
        while todo or running:
            raise_if_stopped()
            for slot in range(len(slots)):
                if slot not in running and todo:
                    running[slot] = start(todo.pop(0), slots[slot], events)
            _drain(events, tally, results)
            for slot, (proc, index, started, log, reader) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[slot]
                reap_worker(proc, reader)
                _drain(events, tally, results)
                if proc.returncode != 0 or index not in results:
                    failed[index] = f"exit {proc.returncode}, log {log}: {last_line(log)}"
                    if stop_others and (running or todo):
                        _stop_all(running, events, tally, results, failed, t_start, stop_others)
                        failed.update((i, f"not started: {stop_others}") for i in todo)
                        todo.clear()
                        break  # every other worker is reaped
                else:
                    _timed(results[index], t_start, started)
            time.sleep(0.1)
    except BaseException:
        for proc, _, _, _, reader in running.values():
            reap_worker(proc, reader, kill=True)
        raise
    return results, failed


def _stop_all(running: dict, events: queue.Queue, tally: Tally, results: dict, failed: dict, t_start: float,
              why: str) -> None:
    """SIGTERM to each running worker (its run ends as on Ctrl-C: committed shards kept, its engine
    stopped), then each is reaped; one that finished meanwhile counts as finished."""
    for proc, *_ in running.values():
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    for slot, (proc, index, started, log, reader) in list(running.items()):
        del running[slot]
        stop_worker(proc, reader)
        _drain(events, tally, results)
        if proc.returncode == 0 and index in results:
            _timed(results[index], t_start, started)
        else:
            results.pop(index, None)
            failed[index] = f"stopped: {why}"


def _timed(result: dict, t_start: float, started: float) -> None:
    """A finished partition's finish time in the run and its own wall time."""
    result.update(finished_s=round(time.perf_counter() - t_start, 2), wall_s=round(time.perf_counter() - started, 2))


def _drain(events: queue.Queue, tally: Tally, results: dict) -> None:
    while True:
        try:
            index, rec = events.get_nowait()
        except queue.Empty:
            return
        if rec["vx"] == "summary":
            results[index] = rec["summary"]
        tally.update(index, rec)


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if ln.startswith("vx: error:")]
    return (errs or lines or [""])[-1][:300]


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """A worker whose launcher (or Ray task) is gone must not keep writing its partition beside a
    retry of it: the kernel kills it with its parent (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get("VX_PARENT_PID")
    if parent and os.getppid() != int(parent):  # the parent died before the call
        os._exit(1)


def run_partition_worker(argv: list[str], run) -> int:
    """The body of a partition worker process (`python -m vx.launch.worker JOB CONFIG_JSON`): dies with its
    launcher, keeps to its cores, and reports progress and the summary that run(config dict,
    reporter) returns as JSON lines on stdout; errors map to exit codes as in the CLI."""
    from vx.errors import quiet_startup, run_guarded
    from vx.monitor.progress import EventProgress

    quiet_startup()

    d = json.loads(argv[0])
    _die_with_parent()
    cores = os.environ.get("VX_CPU_CORES")
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})

    def body() -> int:
        events = EventProgress(sys.stdout, d["partition_index"])
        events.emit("summary", summary=run(d, events))
        return 0

    return run_guarded(body)


def group_alive(pgid: int) -> bool:
    """Whether a process of group pgid is still running (zombies waiting for their reaper are gone)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: ask the kernel (counts zombies too)
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def failed_partitions(failed: dict[int, str], count: int, how: str, kept: str) -> VxError:
    """The one line for partitions that failed: which and why, what is kept, what to do."""
    lines = "; ".join(f"partition {i} ({v})" for i, v in sorted(failed.items()))
    return VxError(f"{len(failed)} of {count} partitions failed{how}: {lines}. {kept}; rerun the same command "
                   "to finish them")
