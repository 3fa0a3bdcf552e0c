"""Multi-node on Ray: `vx extract ... --ray` runs every partition as a Ray task (vx/launch/ray_tasks.py).

vx brings no coordinator of its own. The driver prepares the output once, computes the partition
plan once (shipped to the tasks through Ray's object store) and submits one task per partition,
each asking for one engine's GPUs (`--tensor-parallel-size`). Ray reschedules a failed task, also
when its node is lost (`--max-retries`); the new attempt resumes from the partition's manifest:
with -o s3://... the S3 one, so any node can pick it up.

Every node needs vx installed and the dataset at the same path (a shared filesystem).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import replace

from vx.jobs.config import ExtractConfig
from vx.jobs.data_parallel import RETAIN_STOP, WORKER, combine, make_plan, partition_config
from vx.launch.ray_tasks import (
    cluster_engines,
    connect,
    cpus_per_node,
    plan_payload,
    require_ray,
    run_tasks,
)
from vx.launch.workers import Tally, failed_partitions
from vx.jobs.monitoring import watch_launcher
from vx.monitor.flops import mfu_terms
from vx.monitor.progress import RunProgress


def run_ray(cfg: ExtractConfig, progress: bool | None = None, worker: str = WORKER, prepare=None, finish=None):
    """Every partition as a Ray task; returns the combined Summary (with the node of each).
    worker: each task's module (the one-pass mode's, vx/pipeline/one_pass_parallel.py);
    prepare(cfg, job, plan_file) -> cfg before the tasks start, finish(cfg, results, summary) ->
    summary once all are done."""
    with contextlib.redirect_stdout(sys.stderr):  # Ray's notices (task retried, ...) are logs, not results
        return _run_ray(cfg, progress, worker, prepare, finish)


def _run_ray(cfg: ExtractConfig, progress: bool | None, worker: str, prepare, finish):
    require_ray()
    from vx.jobs.extract import check_dataset, prepare_job, prepare_root

    t0 = time.perf_counter()
    job = prepare_job(cfg)
    if cfg.strict:
        check_dataset(cfg, job)
    connect(cfg.ray_address)
    tp = cfg.tensor_parallel_size
    gpus, engines = cluster_engines(tp)
    if cfg.num_partitions == 1:  # default: one partition per engine the cluster can hold
        cfg = replace(cfg, num_partitions=engines)
    prepare_root(cfg, job)
    t_plan = time.perf_counter()
    plan_file, balance = make_plan(cfg, job)
    balance["plan_s"] = round(time.perf_counter() - t_plan, 2)
    if prepare is not None:
        cfg = prepare(cfg, job, plan_file)
    cpu_share = None
    if not gpus:  # CPU cluster: engines on a node share its memory
        cpu_share = 0.3 / cpus_per_node()
    configs = [partition_config(cfg, i, None, cpu_share=cpu_share, portable=True) for i in range(cfg.num_partitions)]
    bar = RunProgress(sum(balance["lines"]), enabled=progress, every=cfg.progress_every)
    terms = mfu_terms(job.model_dir, job.layer_ids, engines, tp)
    metrics = watch_launcher(bar, cfg, terms)
    t_start = time.perf_counter()
    state = "failed"
    try:
        results, failed, attempts = run_tasks(configs, plan_payload(plan_file), tp if gpus else 0, cfg.max_retries,
                                              Tally(bar, metrics), worker, RETAIN_STOP if cfg.retain_gb else None)
        state = "failed" if failed else "done"
    finally:
        bar.close(state)
        if metrics is not None:
            metrics.close()
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, f" after {cfg.max_retries} retries",
                                "Committed shards are kept")
    s = combine(cfg, job.backend, results, time.perf_counter() - t0, time.perf_counter() - t_start, balance)
    for p in s.partitions:
        r = results[p["partition"]]
        nodes = attempts.get(p["partition"]) or [r.get("node_id")]
        p.update(node=r.get("node"), node_id=r.get("node_id"), attempts=len(nodes), attempt_nodes=nodes)
    s.set_mfu(terms, bar.meter)
    return finish(cfg, results, s) if finish is not None else s
