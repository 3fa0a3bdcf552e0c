"""`vx regenerate` over partitions: data parallel on this node, Ray tasks, or one engine in turn.

The launcher computes the token-balanced partition plan once (vx/launch/plan.py, weights: each
conversation's tokens as `vx extract` reads it), runs each partition as a worker (`python -m
vx.regenerate.partitions CONFIG`: a plain `run_regenerate` of that partition, writing
OUTPUT.parts/part-i-of-P.jsonl, resumable) on an engine slot (vx/launch/workers.py: GPU groups, or on
CPU each slot its share of the cores) or as a Ray task (vx/launch/ray_tasks.py), folds the workers'
progress into one bar (conversations/s, generated tokens/s), and merges the parts into OUTPUT
when all are done. A failed partition is reported when the others are done; rerunning the same
command redoes only what no part records.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from vx.engine.fast_exit import in_spawned_child
from vx.launch.workers import failed_partitions
from vx.regenerate.config import RegenConfig
from vx.regenerate.output import merge_parts, parts_dir

in_spawned_child()  # a partition worker's engine core and worker import this module first: their quick exit

MODULE = "vx.regenerate.partitions"
SUM = ("conversations", "turns", "generated_tokens", "truncated", "dropped", "errors", "skipped")


def prepare_plan(cfg: RegenConfig):
    """(plan file, rows per partition), computed once for every worker."""
    import numpy as np

    from vx.data.inputs import Input
    from vx.data.model import resolve_model
    from vx.regenerate.run import plan_file

    path = plan_file(cfg, Input(cfg.data, cfg.endpoint_url), resolve_model(cfg.model))
    plan = np.load(path)
    return str(path), [int((plan == p).sum()) for p in range(cfg.num_partitions)]


def absolute(path: str | None) -> str | None:
    """A local path (or glob) made absolute: a Ray task runs in another directory. URLs as given."""
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().absolute())


def worker_config(cfg: RegenConfig, index: int, plan_file: str | None, cpu_share: float | None) -> dict:
    child = replace(cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, partition_index=index,
                    plan_file=plan_file, output=cfg.output.resolve(), data=absolute(cfg.data),
                    model=absolute(cfg.model), chat_template=absolute(cfg.chat_template),
                    metrics_port=None, progress_every=None,  # the launcher serves the metrics
                    merge=False)  # and merges the parts once every worker is done (none merges beside another's start)
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.to_json()


def run_partitions(cfg: RegenConfig, progress: bool | None = None) -> dict:
    """Every partition on this node's engine slots, or on Ray; then one OUTPUT. Returns the summary."""
    from vx.launch.plan import part_name
    from vx.launch.workers import Tally, run_workers, spawn_worker, worker_slots
    from vx.monitor.progress import RunProgress
    from vx.regenerate.run import watch_regeneration

    t0 = time.perf_counter()
    failed = None
    if cfg.ray:
        from vx.launch.ray_tasks import cluster_engines, connect, require_ray

        require_ray()
        connect(cfg.ray_address)
        gpus, engines = cluster_engines(cfg.tensor_parallel_size)
        if cfg.num_partitions == 1:  # default: one partition per engine the cluster can hold
            cfg = replace(cfg, num_partitions=engines)
    plan_file, lines = prepare_plan(cfg)
    bar = RunProgress(sum(lines), enabled=progress, label="regenerate", every=cfg.progress_every)
    metrics = watch_regeneration(bar, cfg, None, engines=cfg.num_partitions if cfg.ray else len(worker_slots(cfg)))
    tally = Tally(bar, metrics)
    logs = parts_dir(cfg.output)
    try:
        if cfg.ray:
            from vx.launch.ray_tasks import cpus_per_node, plan_payload, run_tasks

            share = None if gpus else 0.3 / cpus_per_node()
            configs = [worker_config(cfg, i, None, share) for i in range(cfg.num_partitions)]
            results, failed, _ = run_tasks(configs, plan_payload(plan_file),
                                           cfg.tensor_parallel_size if gpus else 0, cfg.max_retries, tally, MODULE)
        else:
            slots = worker_slots(cfg)
            share = None if "CUDA_VISIBLE_DEVICES" in slots[0] else 0.3 / len(slots)

            def start(index: int, slot_env: dict, events):
                log = logs / f"{part_name(index, cfg.num_partitions)}.log"
                proc, reader = spawn_worker(worker_config(cfg, index, plan_file, share), slot_env, log,
                                            lambda rec: events.put((index, rec)), MODULE)
                return proc, index, time.perf_counter(), log, reader

            results, failed = run_workers(cfg.num_partitions, slots, start, tally)
    finally:
        bar.close("failed" if failed is None or failed else "done")
        if metrics is not None:
            metrics.close()
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, "",
                                f"Every committed conversation is kept in {parts_dir(cfg.output)}")
    merged = merge_parts(cfg.output, cfg.num_partitions)  # the last worker did, unless it could not
    summary = {k: sum(r[k] for r in results.values()) for k in SUM}
    summary.update(output=str(cfg.output), conversations_in_output=merged["conversations"],
                   seconds=round(time.perf_counter() - t0, 2),
                   partitions=[{"partition": i, **{k: r[k] for k in ("conversations", "generated_tokens", "skipped")},
                                "node": r.get("node"), "finished_s": r["finished_s"]} for i, r in sorted(results.items())])
    return summary


def worker_main(argv: list[str]) -> int:
    """`python -m vx.regenerate.partitions CONFIG_JSON`: regenerate one partition."""
    from vx.launch.workers import run_partition_worker
    from vx.regenerate.run import run_regenerate

    return run_partition_worker(argv, lambda d, events: run_regenerate(RegenConfig(**d), reporter=events))


if __name__ == "__main__":
    from vx.errors import leave

    leave(worker_main(sys.argv[1:]))
