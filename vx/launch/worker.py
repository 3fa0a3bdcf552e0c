"""The one worker entry point: `python -m vx.launch.worker JOB CONFIG_JSON` runs one partition of
a job (extract, regenerate, one-pass) in this process, as the launcher started it on a node's
slot or in a Ray task: it dies with its launcher, keeps to its cores, and reports progress and
its summary as JSON lines on stdout (vx/launch/workers.py run_partition_worker)."""

from __future__ import annotations

import importlib
import sys

from vx.engine.lifetime.fast_exit import in_spawned_child

in_spawned_child()  # the worker's engine core and workers import this module first: their quick exit

JOBS = {"extract": "vx.jobs.extract", "regenerate": "vx.jobs.regenerate", "one-pass": "vx.jobs.one_pass"}


def main(argv: list[str]) -> int:
    from vx.launch.workers import run_partition_worker

    job = importlib.import_module(JOBS[argv[0]])

    def run(d: dict, events):
        s = job.run(job.config(d), reporter=events)
        return s.to_json() if hasattr(s, "to_json") else s

    return run_partition_worker(argv[1:], run)


if __name__ == "__main__":
    from vx.errors import leave

    leave(main(sys.argv[1:]))
