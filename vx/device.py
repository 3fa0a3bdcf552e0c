"""The accelerator as vx's processes see it, asked in a way that keeps every later fork safe.

torch's `torch.cuda.is_available()` asks the CUDA runtime (`cudaGetDeviceCount`, which runs
`cuInit`) unless `PYTORCH_NVML_BASED_CUDA_CHECK=1`; after that, any process forked from this one
dies on its first CUDA call ("Cannot re-initialize CUDA in forked subprocess"). vLLM forks its
engine unless it sees CUDA initialised (`vllm/utils/system_utils.py`), and it sets the NVML check
itself only when it is imported. So vx sets the NVML check when the `vx` package is imported
(before any of its code can ask torch), and an engine vx starts on a GPU uses the `spawn` start
method explicitly: the choice vLLM makes itself once CUDA is initialised, made by design rather
than by whichever import happened to touch CUDA first.
"""

from __future__ import annotations

import os

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def fork_safe() -> None:
    """Make torch's availability checks use NVML (no CUDA initialisation). Idempotent."""
    os.environ[NVML_CHECK] = "1"


def cuda_available() -> bool:
    """Whether a CUDA device is visible, without initialising CUDA in this process."""
    fork_safe()
    import torch

    return torch.cuda.is_available()


def engine_env(tensor_parallel_size: int = 1) -> bool:
    """The environment of a vLLM engine started from this process; returns whether it runs on CPU."""
    fork_safe()
    # results go to stdout, so vLLM's logs go to stderr
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # the engine core steps on its own (in its process) until the connector has read every
    # finished request; the driver waits for that (drain), so it must not run in-process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    on_cpu = not cuda_available()
    if not on_cpu:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        return False
    # vLLM reserves one core for its engine process by default; on small CPU machines the
    # worker then runs on one thread. vx's engine process only feeds requests.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's auto binding wants a NUMA node per rank; give each rank its share of our cores
        cores = sorted(os.sched_getaffinity(0))
        n = tensor_parallel_size
        ranks = [cores[r * len(cores) // n:(r + 1) * len(cores) // n] or cores[r % len(cores):][:1]
                 for r in range(n)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in ranks)
    return True


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (x86: AVX512-BF16 or AMX-BF16; Arm: BF16). Without
    it torch emulates bf16 matmuls, ~80x slower than its fp32 ones (an AVX2 EPYC here: an HF
    forward of a tiny model 7.5x slower in bf16 than in fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return True  # unknown: the checkpoint's dtype, as before


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), or
    None on a machine without CUDA (or with every GPU hidden)."""
    if not cuda_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()] or None
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_groups(gpus: list[int] | None, need: int) -> list[str] | None:
    """The device names (as CUDA_VISIBLE_DEVICES spells them) of the GPUs to use, or None on a
    machine without CUDA. `--gpus` ids index the GPUs this process sees: under SLURM or
    Kubernetes with CUDA_VISIBLE_DEVICES=4,5,6,7, `--gpus 0,1` is physical GPUs 4 and 5."""
    from vx.errors import UsageError

    visible = visible_gpus()
    if gpus is None:
        if visible is None:
            return None
        ids = visible
    else:
        if visible is None:  # no CUDA here: the ids are taken as given (the workers will say more)
            return [str(g) for g in gpus]
        outside = [g for g in gpus if g >= len(visible)]
        if outside:
            raise UsageError(f"--gpus {','.join(map(str, gpus))}: this process sees {len(visible)} GPUs "
                             f"(CUDA_VISIBLE_DEVICES={','.join(visible) or 'empty'}), so ids must be in "
                             f"0..{len(visible) - 1}; {','.join(map(str, outside))} are outside it")
        ids = [visible[g] for g in gpus]
    if len(ids) < need:
        raise UsageError(f"the engines need {need} GPUs; {len(ids)} visible ({','.join(ids)})")
    return ids
