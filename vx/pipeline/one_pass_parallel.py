"""`vx extract DATA -o OUT --regenerate --data-parallel-size N` (or --gpus): the one-pass job on
N engine slots of this node; with --ray, on a Ray cluster's engines.

The launcher does once what `vx extract --data-parallel-size` does (vx/jobs/data_parallel.py):
the output's identity, the token-balanced partition plan, the engines' max_model_len; and it
checks the generation options (OUT/regenerate.json). Then each partition runs as a worker
(`python -m vx.pipeline.one_pass_parallel CONFIG`) on its slot, a plain one-pass job of that
partition (vx/pipeline/one_pass.py): its regeneration writes
OUT/regenerated.jsonl.parts/part-i-of-P.jsonl and its capture follows that file into
OUT/part-i-of-P/, both engines on the slot's GPUs (or cores). When every partition is done the
launcher merges the parts into OUT/regenerated.jsonl (each conversation once,
vx/regenerate/output.py), not before: a capture reads its part to the end.

With --ray each partition is a Ray task on any node (vx/jobs/ray_cluster.py). A task restores
from S3 the text of what S3 holds states of before its regeneration starts (a retried task lands
on a node without its part), and puts its part's text to S3 before its states
(vx/pipeline/regenerated_text.py); the driver then builds OUT/regenerated.jsonl from S3's text
(or, with a local -o on a shared filesystem, from the parts).

Exactly once, as for one engine: a partition's regeneration skips what its part (or the merged
file) holds, its capture what any partition's manifest holds; a rerun of the same command after
a crash anywhere redoes only the rest, and merges again (idempotent).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from vx.store.format import REGENERATED

WORKER = "vx.pipeline.one_pass_parallel"  # `python -m vx.pipeline.one_pass_parallel CONFIG`: one partition
SUM = ("conversations", "turns", "generated_tokens", "truncated", "dropped", "errors", "skipped")


def run(cfg, progress: bool | None = None):
    """`vx extract --regenerate`: on Ray, on this node's engine slots, or one process (one engine,
    or one --partition-index). Returns extraction's Summary with the regeneration's in it."""
    from vx.pipeline.one_pass import run_one_pass

    if cfg.ray:
        return run_one_pass_ray(cfg, progress)
    if cfg.data_parallel_size > 1:
        return run_one_pass_parallel(cfg, progress)
    return run_one_pass(cfg, progress=progress)


def run_one_pass_parallel(cfg, progress: bool | None = None):
    """Every partition's one-pass job on this node's engine slots, then one regenerated JSONL.
    Returns the combined Summary, with the regenerations' summed in it."""
    from vx.engine.logs import LOG_DIR
    from vx.jobs.data_parallel import RETAIN_STOP, combine, make_plan, partition_config
    from vx.jobs.extract import check_dataset, prepare_job, prepare_root
    from vx.jobs.monitoring import watch_launcher
    from vx.launch.plan import part_name
    from vx.launch.workers import Tally, failed_partitions, run_workers, spawn_worker, worker_slots
    from vx.monitor.flops import mfu_terms
    from vx.monitor.progress import RunProgress

    t0 = time.perf_counter()
    slots = worker_slots(cfg)
    out = Path(cfg.output)
    job = prepare_job(cfg)
    if cfg.strict:
        check_dataset(cfg, job)
    prepare_root(cfg, job)
    plan_file, balance = make_plan(cfg, job)
    cfg = prepare_text(cfg, job, plan_file)
    cpu_share = None if "CUDA_VISIBLE_DEVICES" in slots[0] else 0.15 / len(slots)  # two engines a slot
    logs = out / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    bar = RunProgress(sum(balance["lines"]), enabled=progress, every=cfg.progress_every)
    terms = mfu_terms(job.model_dir, job.layer_ids, len(slots), cfg.tensor_parallel_size)
    metrics = watch_launcher(bar, cfg, terms)

    def start(index: int, slot_env: dict, events):
        log = logs / f"{part_name(index, cfg.num_partitions)}.log"
        proc, reader = spawn_worker(partition_config(cfg, index, plan_file, cpu_share), slot_env, log,
                                    lambda rec: events.put((index, rec)), WORKER)
        return proc, index, time.perf_counter(), log, reader

    t_start = time.perf_counter()
    failed = None
    try:
        results, failed = run_workers(cfg.num_partitions, slots, start, Tally(bar, metrics),
                                      RETAIN_STOP if cfg.retain_gb else None)
    finally:
        bar.close("failed" if failed is None or failed else "done")
        if metrics is not None:
            metrics.close()
    if failed:
        raise failed_partitions(failed, cfg.num_partitions, "", "Every committed conversation and shard is kept")
    s = combine(cfg, job.backend, results, time.perf_counter() - t0, time.perf_counter() - t_start, balance)
    s.set_mfu(terms, bar.meter)
    return finish_text(cfg, results, s, here=True)


def run_one_pass_ray(cfg, progress: bool | None = None):
    """`vx extract --regenerate --ray`: every partition's one-pass job as a Ray task
    (vx/jobs/ray_cluster.py), then one regenerated JSONL: from S3's text with -o s3://, else from
    the parts on the shared filesystem."""
    from vx.jobs.ray_cluster import run_ray

    return run_ray(cfg, progress, worker=WORKER, prepare=prepare_text,
                   finish=lambda c, results, s: finish_text(c, results, s, here=False))


def prepare_text(cfg, job, plan_file):
    """A launcher's part, once before its workers start: the generation options checked
    (OUT/regenerate.json), with -o s3:// the text of what S3 holds states of restored and its
    segments compacted, and both engines' max_model_len. Returns the config the workers get."""
    from vx.pipeline.one_pass import check_rerun, max_model_len
    from vx.pipeline.regenerated_text import text_in_s3
    from vx.regenerate.output import parts_dir

    out = Path(cfg.output)
    check_rerun(cfg, out)
    text = text_in_s3(cfg, out / REGENERATED)  # each worker puts its part's text, the launcher the merged file
    if text is not None and not cfg.overwrite:
        text.restore(out / REGENERATED, tuple(parts_dir(out / REGENERATED).glob("part-*.jsonl")))
    if not cfg.max_model_len:  # once, for every worker's two engines
        cfg = replace(cfg, max_model_len=max_model_len(cfg, job, Path(plan_file)))
    return cfg


def finish_text(cfg, results: dict, s, here: bool):
    """Once every partition is done: one OUT/regenerated.jsonl (here: from the parts on this node;
    else from S3's text, or the parts on the shared filesystem), its engine logs moved to OUT/logs,
    and the regenerations' sums in the Summary."""
    from vx.engine.logs import LOG_DIR
    from vx.pipeline.regenerated_text import text_in_s3
    from vx.regenerate.output import merge_parts, parts_dir

    out = Path(cfg.output)
    text = text_in_s3(cfg, out / REGENERATED)
    if text is not None and not here:
        merged = {"conversations": text.merge_from_s3(), "complete": True}
    else:
        merged = merge_parts(out / REGENERATED, cfg.num_partitions)
        if merged["complete"]:  # what is left there: the parts' commit marks, locks and engine logs
            for log in parts_dir(out / REGENERATED).glob("*.vllm.log"):
                log.replace(out / LOG_DIR / f"regenerate-{log.name.removesuffix('.jsonl.vllm.log')}.vllm.log")
            shutil.rmtree(parts_dir(out / REGENERATED), ignore_errors=True)
            if text is not None:
                text.finish()
    s.regenerated = {k: sum((r.get("regenerated") or {}).get(k, 0) for r in results.values()) for k in SUM}
    where = f"{cfg.upload.rstrip('/')}/{REGENERATED}" if text is not None else str(out / REGENERATED)
    s.regenerated.update(output=where, conversations_in_output=merged["conversations"])
    return s


def worker_main(argv: list[str]) -> int:
    """`python -m vx.pipeline.one_pass_parallel CONFIG_JSON`: the one-pass job of one partition."""
    from vx.jobs.config import ExtractConfig
    from vx.launch.workers import run_partition_worker
    from vx.pipeline.one_pass import run_one_pass

    return run_partition_worker(argv, lambda d, events: run_one_pass(ExtractConfig(**d), reporter=events).to_json())


if __name__ == "__main__":
    from vx.errors import leave

    leave(worker_main(sys.argv[1:]))
