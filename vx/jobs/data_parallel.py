"""Data parallel on one node: N engines, one per GPU group, over P token-balanced partitions.

`vx extract DATA -o OUT --data-parallel-size N` (or `--gpus 0,1,2,3`) runs here. The launcher
prepares the output once (identity, --overwrite, S3 preflight) and computes the partition plan
once; then it keeps N worker processes busy (vx/launch/workers.py), each running one partition
(`python -m vx.jobs.data_parallel CONFIG`) on its GPU group (CUDA_VISIBLE_DEVICES; tensor
parallel inside the group) or, on CPU, its own cores. A worker is a plain `run_extract` of one
partition: its own shard sequence and manifest under OUT/part-i-of-P/, its own S3 prefix, its own
resume. Workers report progress as JSON lines on stdout; their logs go to OUT/logs/. A dead
worker is reported when the others are done (under --retain-gb the others are stopped at once:
they would wait for readers that wait for it); rerunning the same command redoes only what no
manifest records.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from vx.engine.logs import LOG_DIR
from vx.jobs.config import ExtractConfig
from vx.jobs.monitoring import watch_launcher
from vx.monitor.flops import mfu_terms
from vx.launch.workers import (
    Tally,
    failed_partitions,
    run_partition_worker,
    run_workers,
    spawn_worker,
    worker_slots,
)
from vx.monitor.progress import RunProgress
from vx.store.output import Output

WORKER = "vx.jobs.data_parallel"  # `python -m vx.jobs.data_parallel CONFIG`: one partition's worker


def partition_config(cfg: ExtractConfig, index: int, plan_file: str | None, cpu_share: float | None = None,
                     portable: bool = False) -> dict:
    """The JSON config of one partition's worker. cpu_share: on CPU, vLLM's memory fraction is of
    host memory, which the engines of a node share."""
    child = replace(cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, overwrite=False,
                    partition_index=index, plan_file=plan_file, verify=0,  # the launcher verifies the whole run
                    metrics_port=None, progress_every=None)  # and serves the metrics, labelled by partition
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.portable_json() if portable else child.to_json()


def run_data_parallel(cfg: ExtractConfig, progress: bool | None = None):
    """Run every partition on this node's engine slots; returns the combined Summary."""
    from vx.jobs.extract import prepare_job, prepare_root

    t0 = time.perf_counter()
    slots = worker_slots(cfg)
    job = prepare_job(cfg)
    if cfg.strict:
        from vx.jobs.extract import check_dataset

        check_dataset(cfg, job)
    prepare_root(cfg, job)
    t_plan = time.perf_counter()
    plan_file, balance = make_plan(cfg, job)
    balance["plan_s"] = round(time.perf_counter() - t_plan, 2)
    cpu_share = None if "CUDA_VISIBLE_DEVICES" in slots[0] else 0.3 / len(slots)
    logs = Path(cfg.output) / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    bar = RunProgress(sum(balance["lines"]) - len(Output.of(cfg).committed_elsewhere()), enabled=progress,
                      every=cfg.progress_every)
    terms = mfu_terms(job.model_dir, job.layer_ids, len(slots), cfg.tensor_parallel_size)
    metrics = watch_launcher(bar, cfg, terms)
    t_start = time.perf_counter()
    state = "failed"
    try:
        stop = RETAIN_STOP if cfg.retain_gb else None
        results, failed = run_workers(cfg.num_partitions, slots, lambda index, slot_env, events: _start(
            cfg, index, slot_env, plan_file, cpu_share, logs, events), Tally(bar, metrics), stop)
        state = "failed" if failed else "done"
    finally:
        bar.close(state)
        if metrics is not None:
            metrics.close()
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, "", "The others' work and every committed shard are kept")
    s = combine(cfg, job.backend, results, time.perf_counter() - t0, time.perf_counter() - t_start, balance)
    s.set_mfu(terms, bar.meter)
    return s


# under --retain-gb a writer waits for readers to consume its shards, and a reader following the
# run waits for the failed partition's next ones: the others would wait for good, so they are stopped
RETAIN_STOP = "under --retain-gb its writer would wait for readers that wait for the failed partition"


def make_plan(cfg: ExtractConfig, job) -> tuple[str, dict]:
    import numpy as np

    from vx.launch.plan import load_or_make_plan

    path = load_or_make_plan(cfg.output, job.source, job.model_dir, job.info.fingerprint, cfg.num_partitions,
                             cfg.reading())
    plan = np.load(path)
    return str(path), {"lines": [int((plan == p).sum()) for p in range(cfg.num_partitions)]}


def _start(cfg, index, slot_env, plan_file, cpu_share, logs, events):
    from vx.launch.plan import part_name

    log = logs / f"{part_name(index, cfg.num_partitions)}.log"
    with open(log, "a") as f:
        f.write(f"--- partition {index} started {time.strftime('%Y-%m-%d %H:%M:%S')} with "
                f"{json.dumps(slot_env)}\n")
    proc, reader = spawn_worker(partition_config(cfg, index, plan_file, cpu_share), slot_env, log,
                                lambda rec: events.put((index, rec)), WORKER)
    return proc, index, time.perf_counter(), log, reader


def combine(cfg, backend: str, results: dict[int, dict], total_s: float, extract_s: float, balance: dict):
    """One Summary for the run: sums, and per partition its samples, tokens and finish time."""
    from vx.jobs.summary import Summary
    from vx.launch.plan import spread

    parts = [dict(partition=i, **{k: r[k] for k in ("samples", "tokens", "errors", "resumed_samples", "shards",
                                                     "bytes_written", "load_s", "warmup_s", "extract_s")},
                  finished_s=r.get("finished_s"), wall_s=r.get("wall_s"), upload_mb_s=r.get("upload_mb_s"))
             for i, r in sorted(results.items())]
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
                extract_s, cfg.upload, sum(r.get("uploaded_bytes", 0) for r in results.values()),
                upload_rate(results.values()),
                max((r.get("peak_local_bytes", 0) for r in results.values()), default=0),
                max((r.get("max_model_len") or 0 for r in results.values()), default=0) or None,
                partitions=parts, balance=balance)
    return s


def upload_rate(partitions) -> float:
    """MB/s of the partitions' uploads, from their own durations (each partition's bytes over its
    rate): the bytes over the time an uploader spent sending them."""
    sent = [(r.get("uploaded_bytes", 0), r.get("upload_mb_s") or 0.0) for r in partitions]
    seconds = sum(b / (mb_s * 1e6) for b, mb_s in sent if b and mb_s)
    return sum(b for b, _ in sent) / seconds / 1e6 if seconds else 0.0


def worker_main(argv: list[str]) -> int:
    """`python -m vx.jobs.data_parallel CONFIG_JSON`: extract one partition."""
    from vx.jobs.extract import run_extract

    return run_partition_worker(argv, lambda d, events: run_extract(ExtractConfig(**d), reporter=events).to_json())


if __name__ == "__main__":
    from vx.errors import leave

    leave(worker_main(sys.argv[1:]))
