"""The one launcher: any job (vx/jobs/: extract, regenerate, one pass) in this process, on this
node's engine slots, or as Ray tasks.

A job is a module with three functions and a few constants (vx/launch/job.py says what each is):

    prepare(cfg) -> Prepared        once, here: the output's identity, --overwrite, S3 preflight,
                                    the partition plan; what every worker shares
    run(cfg, progress, reporter)    one partition (or the whole input) in whatever process runs it
    finish(prepared, results)       once every partition is done: merge, combine the summaries

The launcher owns where a partition runs, its retries, the progress of all of them folded into
one bar, and the one line for partitions that failed. A worker process is
`python -m vx.launch.worker JOB CONFIG_JSON` (vx/launch/worker.py), on a node's slot or in a Ray
task on any node.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import replace

from vx.launch.workers import Tally, failed_partitions, run_workers, spawn_worker, worker_slots
from vx.monitor.progress import RunProgress


def launch(job, cfg, progress: bool | None = None):
    """Run `job` (a job module) with `cfg` where cfg says: one partition or the whole input in this
    process, every partition on this node's engine slots, or on a Ray cluster. Returns its summary."""
    if cfg.partition_index is None and cfg.ray:
        with contextlib.redirect_stdout(sys.stderr):  # Ray's notices (task retried, ...) are logs, not results
            return _on_ray(job, cfg, progress)
    if cfg.partition_index is None and (cfg.data_parallel_size > 1 or cfg.num_partitions > 1):
        return _on_node(job, cfg, progress)
    return job.run(cfg, progress=progress)


def _on_node(job, cfg, progress):
    """Every partition on this node's engine slots (GPU groups; on CPU each its share of the
    cores), a freed slot taking the next partition; a failed partition reported once the others
    are done (or, where the job says so, the others stopped with it)."""
    from vx.store.format import part_name

    t0 = time.perf_counter()
    slots = worker_slots(cfg)
    prep = job.prepare(cfg)
    cfg = prep.cfg
    share = None if "CUDA_VISIBLE_DEVICES" in slots[0] else job.MEMORY_SHARE / len(slots)
    prep.logs.mkdir(parents=True, exist_ok=True)

    def start(index: int, slot_env: dict, events):
        log = prep.logs / f"{part_name(index, cfg.num_partitions)}.log"
        with open(log, "a") as f:
            f.write(f"--- partition {index} started {time.strftime('%Y-%m-%d %H:%M:%S')} with {json.dumps(slot_env)}\n")
        proc, reader = spawn_worker(job.worker_config(prep, index, prep.plan_file, share), slot_env, log,
                                    lambda rec: events.put((index, rec)), job.NAME)
        return proc, index, time.perf_counter(), log, reader

    results, failed = _gather(job, prep, progress, len(slots),
                              lambda tally: run_workers(cfg.num_partitions, slots, start, tally, prep.stop_others))
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, "", prep.kept)
    return job.finish(prep, results, t0)


def _on_ray(job, cfg, progress):
    """Every partition as a Ray task on an existing cluster, retried by Ray (--max-retries); each
    task runs the same worker process on its node (vx/launch/ray_tasks.py)."""
    from vx.launch.ray_tasks import cluster_engines, connect, cpus_per_node, plan_payload, require_ray, run_tasks

    require_ray()
    t0 = time.perf_counter()
    connect(cfg.ray_address)
    gpus, engines = cluster_engines(cfg.tensor_parallel_size)
    if cfg.num_partitions == 1:  # default: one partition per engine the cluster can hold
        cfg = replace(cfg, num_partitions=engines)
    prep = job.prepare(cfg)
    cfg = prep.cfg
    share = None if gpus else job.MEMORY_SHARE / cpus_per_node()  # a CPU node's engines share its memory
    configs = [job.worker_config(prep, i, None, share, portable=True) for i in range(cfg.num_partitions)]
    attempts: dict = {}

    def tasks(tally):
        results, failed, tried = run_tasks(configs, plan_payload(prep.plan_file),
                                           cfg.tensor_parallel_size if gpus else 0, cfg.max_retries, tally,
                                           job.NAME, prep.stop_others)
        attempts.update(tried)
        return results, failed

    results, failed = _gather(job, prep, progress, engines, tasks)
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, f" after {cfg.max_retries} retries", prep.kept)
    for index, r in results.items():  # where each partition ran: its node, and every attempt's
        nodes = attempts.get(index) or [r.get("node_id")]
        r.update(attempts=len(nodes), attempt_nodes=nodes)
    return job.finish(prep, results, t0)


def _gather(job, prep, progress, engines: int, run):
    """run(tally) -> (results, failed), with the workers' progress folded into one bar and the
    job's metrics server; the bar ends done or failed."""
    bar = RunProgress(prep.todo, enabled=progress, label=job.LABEL, every=prep.cfg.progress_every)
    metrics = job.watch(bar, prep, engines)
    failed = None
    try:
        t_start = time.perf_counter()
        results, failed = run(Tally(bar, metrics))
    finally:
        bar.close("failed" if failed is None or failed else "done")
        if metrics is not None:
            metrics.close()
    prep.bar, prep.t_start = bar, t_start
    return results, failed
