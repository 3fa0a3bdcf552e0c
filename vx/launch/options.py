"""The engine and scale-out options that `vx extract` and `vx regenerate` share, defined and
checked in one place (both configs are an Engines)."""

from __future__ import annotations

from dataclasses import dataclass

from vx.errors import UsageError


@dataclass(kw_only=True)
class Engines:
    # vllm engine flags, named as vLLM names them
    max_num_seqs: int | None = None
    max_model_len: int | None = None         # None: the job's longest request (from the plan)
    gpu_memory_utilization: float | None = None  # None: 0.9 on GPU, 0.3 of host memory on CPU
    tensor_parallel_size: int = 1
    # where the engines run (vx/launch/launcher.py)
    data_parallel_size: int = 1              # engines on this node, one per GPU group (CPU: per core group)
    gpus: list[int] | None = None            # GPU ids to use, in groups of tensor_parallel_size
    num_partitions: int = 1                  # the dataset split, token-balanced, into this many parts
    partition_index: int | None = None       # run exactly this partition (SLURM arrays and the like)
    ray: bool = False                        # schedule partitions as Ray tasks on an existing cluster
    ray_address: str | None = None           # default: auto (RAY_ADDRESS or a local cluster)
    max_retries: int = 3                     # ray: reschedules of a failed partition
    # watching a long run (vx/monitor/)
    metrics_port: int | None = None          # serve Prometheus metrics here (0: any free port, logged)
    progress_every: float | None = None      # not a terminal: a progress line every this many s (None: 30)
    plan_file: str | None = None             # internal: the partition plan a launcher computed


def check_engine_options(cfg) -> None:
    """--tensor-parallel-size/--max-num-seqs/--max-model-len/--gpu-memory-utilization of a config
    (extract and regenerate): in range before any engine starts, or one line saying which."""
    if cfg.tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {cfg.tensor_parallel_size}")
    for name in ("max_num_seqs", "max_model_len"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if cfg.gpu_memory_utilization is not None and not 0 < cfg.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")


def check_scale_out(cfg) -> None:
    """--data-parallel-size/--gpus/--num-partitions/--partition-index/--ray/--max-retries of a config
    (extract and regenerate): consistent, or one line saying why; --gpus sets data_parallel_size."""
    for name in ("data_parallel_size", "num_partitions"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_retries < 0:
        raise UsageError(f"--max-retries must be >= 0, got {cfg.max_retries}")
    if cfg.gpus is not None:
        if not cfg.gpus or len(set(cfg.gpus)) != len(cfg.gpus) or min(cfg.gpus) < 0:
            raise UsageError(f"--gpus must list distinct GPU ids, got {cfg.gpus}")
        if len(cfg.gpus) % cfg.tensor_parallel_size:
            raise UsageError(f"--gpus lists {len(cfg.gpus)} GPUs, not a multiple of --tensor-parallel-size "
                             f"{cfg.tensor_parallel_size}")
        n = len(cfg.gpus) // cfg.tensor_parallel_size
        if cfg.data_parallel_size not in (1, n):
            raise UsageError(f"--gpus gives {n} engines of {cfg.tensor_parallel_size} GPUs, but "
                             f"--data-parallel-size is {cfg.data_parallel_size}")
        cfg.data_parallel_size = n
    if cfg.partition_index is not None:
        if not 0 <= cfg.partition_index < cfg.num_partitions:
            raise UsageError(f"--partition-index must be in [0, {cfg.num_partitions}) for --num-partitions "
                             f"{cfg.num_partitions}, got {cfg.partition_index}")
        if cfg.data_parallel_size > 1 or cfg.ray:
            raise UsageError("--partition-index runs one partition in this process; it does not combine "
                             "with --data-parallel-size, --gpus or --ray")
        if getattr(cfg, "overwrite", False):
            raise UsageError("--overwrite with --partition-index would delete the other partitions' work; "
                             "delete the output once before submitting the partitions, or use a new -o")
    elif cfg.ray:
        if cfg.data_parallel_size > 1:
            raise UsageError("--ray schedules partitions on the cluster's GPUs: give --num-partitions, not "
                             "--data-parallel-size/--gpus")
    elif cfg.data_parallel_size > 1:
        if cfg.num_partitions == 1:
            cfg.num_partitions = cfg.data_parallel_size
        elif cfg.num_partitions < cfg.data_parallel_size:
            raise UsageError(f"--num-partitions {cfg.num_partitions} < --data-parallel-size "
                             f"{cfg.data_parallel_size} would leave engines idle")
    elif cfg.num_partitions > 1:
        raise UsageError("--num-partitions needs --partition-index (one partition, e.g. a SLURM array "
                         "task), --data-parallel-size N or --ray (all of them)")
