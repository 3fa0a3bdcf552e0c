"""The device's dense bf16 peak FLOP/s, the denominator of MFU.

GPUs: the datasheet figure by device name (dense, no sparsity). CPU: measured once (the faster of
a bf16 and an fp32 matmul on every core this process may use, best of a few windows), stored per
core in the vx cache by CPU model and torch version, and scaled to the cores the engine gets. Both
dtypes because a CPU without bf16 units emulates bf16 ~80x slower than its fp32, and vLLM's CPU
kernels reach fp32 speed: a bf16-only peak put MFU above 100%.
"""

from __future__ import annotations

import json
import os
import platform
import time

# dense bf16 tensor FLOP/s from the vendors' datasheets; longest matching name wins
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "B200": 2250e12, "GB200": 2500e12,
             "B300": 2250e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
             "RTX PRO 6000": 504e12, "A10G": 70e12, "A10": 125e12}


def gpu_peak(name: str) -> float | None:
    return next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def gpu_names() -> list[str]:
    """Names of the GPUs this process may use, from NVML (never initialises CUDA here)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    from vx.monitor.probe import visible_handles

    return [_str(pynvml.nvmlDeviceGetName(h)) for h in visible_handles(pynvml)]


def _str(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_per_core() -> float:
    """bf16 matmul FLOP/s per core on this CPU: measured once, then read from the vx cache."""
    import torch

    from vx.home import cache_dir

    key = f"{cpu_model()} / torch {torch.__version__} / bf16|fp32"
    path = cache_dir() / "cpu-peak.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return float(known[key])
    cores = max(1, len(os.sched_getaffinity(0)))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        per_core = max(_matmul_flops(dtype) for dtype in (torch.bfloat16, torch.float32)) / cores
    finally:
        torch.set_num_threads(threads)
    known[key] = per_core
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return per_core


def _matmul_flops(dtype, n: int = 1024, windows: int = 3, window_s: float = 0.2) -> float:
    """FLOP/s of an n x n matmul in `dtype`: the best of `windows` timed windows (a loaded machine
    slows some windows; the peak is what the cores can do)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm
    best = 0.0
    for _ in range(windows):
        k, t = 0, time.perf_counter()
        while time.perf_counter() - t < window_s:
            a @ b
            k += 1
        best = max(best, 2 * n ** 3 * k / (time.perf_counter() - t))
    return best


def peak_flops(devices: int = 1, cpu_cores: int | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of `devices` GPUs, or of `cpu_cores` cores on CPU; what it is), None if unknown."""
    from vx.device import cuda_available

    if cuda_available():
        names = gpu_names()
        peak = gpu_peak(names[0]) if names else None
        if peak is None:
            return None, f"no known bf16 peak for {names[0] if names else 'this GPU'}"
        return peak * devices, f"{devices} x {names[0]} at {peak / 1e12:,.0f} TFLOP/s bf16 dense"
    cores = cpu_cores or max(1, len(os.sched_getaffinity(0)))
    per = cpu_peak_per_core()
    return per * cores, f"{cores} CPU cores at {per / 1e9:,.1f} GFLOP/s each (measured: the faster of bf16 and fp32 matmul)"
