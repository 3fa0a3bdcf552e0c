"""`vx regenerate` as the launcher runs it (vx/launch/launcher.py): the target writes the assistant
turns (vx/regenerate/run.py), over token-balanced partitions on this node's engine slots, on Ray,
or one engine taking them in turn.

prepare() computes the partition plan once (vx/launch/plan.py, weights: each conversation's tokens
as `vx extract` reads it); run() = run_regenerate of one partition, writing
OUTPUT.parts/part-i-of-P.jsonl, resumable; finish() merges the parts into OUTPUT once all are done.
A failed partition is reported when the others are done; rerunning the same command redoes only
what no part records.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from vx.regenerate.config import RegenConfig
from vx.regenerate.output import merge_parts, parts_dir
from vx.regenerate.run import run_regenerate, watch_regeneration

NAME, LABEL = "regenerate", "regenerate"
MEMORY_SHARE = 0.3  # of a CPU node's host memory, for all its engines
SUM = ("conversations", "turns", "generated_tokens", "truncated", "dropped", "errors", "skipped")

run = run_regenerate


def config(d: dict) -> RegenConfig:
    return RegenConfig(**d)


def prepare(cfg: RegenConfig):
    """The partition plan and its rows per partition, once for every worker."""
    import numpy as np

    from vx.data.inputs import Input
    from vx.data.model import resolve_model
    from vx.launch.job import Prepared
    from vx.regenerate.run import plan_file

    path = plan_file(cfg, Input(cfg.data, cfg.endpoint_url), resolve_model(cfg.model))
    plan = np.load(path)
    lines = [int((plan == p).sum()) for p in range(cfg.num_partitions)]
    return Prepared(cfg, str(path), lines, sum(lines), parts_dir(cfg.output),
                    f"Every committed conversation is kept in {parts_dir(cfg.output)}")


def absolute(path: str | None) -> str | None:
    """A local path (or glob) made absolute: a Ray task runs in another directory. URLs as given."""
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().absolute())


def worker_config(prep, index: int, plan_file: str | None, cpu_share: float | None, portable: bool = False) -> dict:
    cfg = prep.cfg
    child = replace(cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, partition_index=index,
                    plan_file=plan_file, output=cfg.output.resolve(), data=absolute(cfg.data),
                    model=absolute(cfg.model), chat_template=absolute(cfg.chat_template),
                    metrics_port=None, progress_every=None,  # the launcher serves the metrics
                    merge=False)  # and merges the parts once every worker is done (none merges beside another's start)
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.to_json()


def watch(bar, prep, engines: int):
    return watch_regeneration(bar, prep.cfg, None, engines=engines)


def finish(prep, results: dict, t0: float) -> dict:
    cfg = prep.cfg
    merged = merge_parts(cfg.output, cfg.num_partitions)
    summary = {k: sum(r[k] for r in results.values()) for k in SUM}
    summary.update(output=str(cfg.output), conversations_in_output=merged["conversations"],
                   seconds=round(time.perf_counter() - t0, 2),
                   partitions=[{"partition": i, **{k: r[k] for k in ("conversations", "generated_tokens", "skipped")},
                                "node": r.get("node"), "finished_s": r["finished_s"]} for i, r in sorted(results.items())])
    return summary
