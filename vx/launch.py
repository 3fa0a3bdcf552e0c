"""Data parallel on one node: N engines, one per GPU group, over P token-balanced partitions.

`vx extract DATA -o OUT --data-parallel-size N` (or `--gpus 0,1,2,3`) runs here. The launcher
prepares the output once (identity, --overwrite, S3 preflight) and computes the partition plan
once; then it keeps N worker processes busy, each running one partition (`python -m vx.launch
CONFIG`) on its GPU group (CUDA_VISIBLE_DEVICES; tensor parallel inside the group) or, on CPU,
its own cores. A worker is a plain `run_extract` of one partition: its own shard sequence and
manifest under OUT/part-i-of-P/, its own S3 prefix, its own resume. Workers report progress as
JSON lines on stdout; their logs go to OUT/logs/. A dead worker is reported when the others are
done; rerunning the same command redoes only what no manifest records.
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
from dataclasses import replace
from pathlib import Path

from .config import ExtractConfig
from .errors import UsageError, VxError
from .output import Output
from .progress import RunProgress

LOG_DIR = "logs"
GROUP_EXIT_S = 30.0  # a finished worker's engine processes get this long after SIGTERM, then SIGKILL


def worker_slots(cfg: ExtractConfig) -> list[dict[str, str]]:
    """The environment of each engine slot: its GPUs, or on a CPU machine its share of the cores."""
    n, tp = cfg.data_parallel_size, cfg.tensor_parallel_size
    from .device import gpu_groups

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


def partition_config(cfg: ExtractConfig, index: int, plan_file: str | None, cpu_share: float | None = None,
                     portable: bool = False) -> dict:
    """The JSON config of one partition's worker. cpu_share: on CPU, vLLM's memory fraction is of
    host memory, which the engines of a node share."""
    child = replace(cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, overwrite=False,
                    partition_index=index, plan_file=plan_file, verify=0)  # the launcher verifies the whole run
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.portable_json() if portable else child.to_json()


def worker_command(config: dict, module: str = "vx.launch") -> list[str]:
    return [sys.executable, "-m", module, json.dumps(config)]


def spawn_worker(config: dict, extra_env: dict, log: Path, on_event,
                 module: str = "vx.launch") -> tuple[subprocess.Popen, threading.Thread]:
    """Start one partition's worker (`python -m MODULE CONFIG`: vx.launch extracts, vx.regen_launch
    regenerates): its own session (its vLLM engine processes go with it), stderr appended to
    `log`, each JSON event of its stdout handed to on_event(rec) by a reader thread."""
    env = dict(os.environ, **extra_env, VX_PARTITION=str(config["partition_index"]),
               VX_PARENT_PID=str(os.getpid()))
    with open(log, "a") as err:
        proc = subprocess.Popen(worker_command(config, module), env=env, stdout=subprocess.PIPE, stderr=err, text=True,
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
    from .reaper import group_alive

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
    """Progress of every partition (latest counts per worker attempt) folded into one bar."""

    def __init__(self, bar: RunProgress):
        self.bar, self.seen, self.shown = bar, {}, (0, 0, 0)

    def update(self, key, rec: dict) -> None:
        self.seen[key] = (rec["samples"], rec["tokens"], rec["skipped"])
        s, t, k = (sum(v[i] for v in self.seen.values()) for i in range(3))
        ds, dt, dk = s - self.shown[0], t - self.shown[1], k - self.shown[2]
        if ds > 0:
            self.bar.advance(ds, dt, 0)
        if dk > 0:
            self.bar.skip(dk)
        self.shown = (max(s, self.shown[0]), max(t, self.shown[1]), max(k, self.shown[2]))


def run_data_parallel(cfg: ExtractConfig, progress: bool | None = None):
    """Run every partition on this node's engine slots; returns the combined Summary."""
    from .extract import prepare_job, prepare_root

    t0 = time.perf_counter()
    slots = worker_slots(cfg)
    job = prepare_job(cfg)
    if cfg.strict:
        from .extract import check_dataset

        check_dataset(cfg, job)
    prepare_root(cfg, job)
    t_plan = time.perf_counter()
    plan_file, balance = make_plan(cfg, job)
    balance["plan_s"] = round(time.perf_counter() - t_plan, 2)
    cpu_share = None if "CUDA_VISIBLE_DEVICES" in slots[0] else 0.3 / len(slots)
    logs = Path(cfg.output) / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    bar = RunProgress(sum(balance["lines"]) - len(Output.of(cfg).committed_elsewhere()), enabled=progress)
    t_start = time.perf_counter()
    try:
        results, failed = run_workers(cfg.num_partitions, slots, lambda index, slot_env, events: _start(
            cfg, index, slot_env, plan_file, cpu_share, logs, events), Tally(bar))
    finally:
        bar.close()
    if failed:
        lines = "; ".join(f"partition {i} ({v})" for i, v in sorted(failed.items()))
        raise VxError(f"{len(failed)} of {cfg.num_partitions} partitions failed: {lines}. The others' work and "
                      "every committed shard are kept; rerun the same command to finish the failed partitions")
    return combine(cfg, job.backend, results, time.perf_counter() - t0, time.perf_counter() - t_start, balance)


def run_workers(count: int, slots: list[dict], start, tally: Tally) -> tuple[dict[int, dict], dict[int, str]]:
    """Keep every slot busy with the next of `count` partitions until all ran. start(index,
    slot_env, events) spawns one worker and returns (proc, index, start time, log, reader); its
    events go to `events` as (index, rec). Returns (summary and timing of each partition that
    finished, reason of each that failed); on an exception every running worker is killed."""
    events: queue.Queue = queue.Queue()
    todo = list(range(count))
    running: dict[int, tuple] = {}  # slot -> (proc, partition, start, log, stdout reader)
    results: dict[int, dict] = {}
    failed: dict[int, str] = {}
    t_start = time.perf_counter()
    try:
        while todo or running:
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
                else:
                    results[index].update(finished_s=round(time.perf_counter() - t_start, 2),
                                          wall_s=round(time.perf_counter() - started, 2))
            time.sleep(0.1)
    except BaseException:
        for proc, _, _, _, reader in running.values():
            reap_worker(proc, reader, kill=True)
        raise
    return results, failed


def make_plan(cfg: ExtractConfig, job) -> tuple[str, dict]:
    import numpy as np

    from .partition import load_or_make_plan

    path = load_or_make_plan(cfg.output, job.source, job.model_dir, job.info.fingerprint, cfg.num_partitions,
                             cfg.reading())
    plan = np.load(path)
    return str(path), {"lines": [int((plan == p).sum()) for p in range(cfg.num_partitions)]}


def _start(cfg, index, slot_env, plan_file, cpu_share, logs, events):
    from .partition import part_name

    log = logs / f"{part_name(index, cfg.num_partitions)}.log"
    with open(log, "a") as f:
        f.write(f"--- partition {index} started {time.strftime('%Y-%m-%d %H:%M:%S')} with "
                f"{json.dumps(slot_env)}\n")
    proc, reader = spawn_worker(partition_config(cfg, index, plan_file, cpu_share), slot_env, log,
                                lambda rec: events.put((index, rec)))
    return proc, index, time.perf_counter(), log, reader


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


def combine(cfg, backend: str, results: dict[int, dict], total_s: float, extract_s: float, balance: dict):
    """One Summary for the run: sums, and per partition its samples, tokens and finish time."""
    from .extract import Summary
    from .partition import spread

    parts = [dict(partition=i, **{k: r[k] for k in ("samples", "tokens", "errors", "resumed_samples", "shards",
                                                     "bytes_written", "load_s", "warmup_s", "extract_s")},
                  finished_s=r.get("finished_s"), wall_s=r.get("wall_s")) for i, r in sorted(results.items())]
    finish = [p["finished_s"] for p in parts if p["finished_s"] is not None]
    starts = [p["finished_s"] - p["extract_s"] for p in parts if p["finished_s"] is not None]
    if finish:  # from the first engine's first sample to the last engine's end (loads excluded)
        extract_s = max(finish) - min(starts)
    tokens = [p["tokens"] for p in parts]
    balance = dict(balance, tokens=tokens, token_spread=round(spread(tokens), 5),
                   finish_spread_s=round(max(finish) - min(finish), 2) if finish else 0.0)
    s = Summary(str(cfg.output), backend, *(sum(p[k] for p in parts) for k in
                ("samples", "tokens", "errors", "resumed_samples", "shards", "bytes_written")),
                max((p["load_s"] for p in parts), default=0.0), max((p["warmup_s"] for p in parts), default=0.0),
                extract_s, cfg.upload, sum(r.get("uploaded_bytes", 0) for r in results.values()), 0.0,
                max((r.get("peak_local_bytes", 0) for r in results.values()), default=0),
                max((r.get("max_model_len") or 0 for r in results.values()), default=0) or None,
                partitions=parts, balance=balance)
    return s


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
    """The body of a partition worker process (`python -m MODULE CONFIG_JSON`): dies with its
    launcher, keeps to its cores, and reports progress and the summary that run(config dict,
    reporter) returns as JSON lines on stdout; errors map to exit codes as in the CLI."""
    from .cli import run_guarded
    from .progress import EventProgress

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


def worker_main(argv: list[str]) -> int:
    """`python -m vx.launch CONFIG_JSON`: extract one partition."""
    from .extract import run_extract

    return run_partition_worker(argv, lambda d, events: run_extract(ExtractConfig(**d), reporter=events).to_json())


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
