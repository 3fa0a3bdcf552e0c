"""What a job tells the launcher (vx/launch/launcher.py).

A job module (vx/jobs/extract.py, regenerate.py, one_pass.py) defines:

    NAME          its name for the worker entry point: `python -m vx.launch.worker NAME CONFIG`
    LABEL         the progress bar's and the metrics' label
    MEMORY_SHARE  on a CPU node, the share of host memory all its engines take together
    config(d)     its config from a worker's JSON
    prepare(cfg) -> Prepared        once, before any worker
    worker_config(prepared, index, plan_file, cpu_share, portable=False) -> dict
    watch(bar, prepared, engines)   its live figures over the workers' events; the metrics server or None
    run(cfg, progress=None, reporter=None)   one partition, or the whole input, in this process
    finish(prepared, results, t0)   once every partition is done: the run's summary
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Prepared:
    cfg: object                  # the config the workers are made from (prepare may have filled it in)
    plan_file: str               # the partition plan, computed once
    lines: list[int]             # rows per partition
    todo: int                    # rows the progress bar counts
    logs: Path                   # a node's workers' logs, one a partition
    kept: str                    # what a failed run keeps: the end of the failed partitions' line
    stop_others: str | None = None  # why the others stop when one fails (None: they finish)
    extra: dict = field(default_factory=dict)  # what the job's own finish needs
    bar: object = None           # set by the launcher: the bar its workers' progress went to
    t_start: float = 0.0         # and when the first worker was started
