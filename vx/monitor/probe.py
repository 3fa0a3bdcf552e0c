"""Device readings for the live figures: memory in use and utilisation of the GPUs this process
may use (NVML: the engine's processes hold the memory, this one only asks), or on CPU the
resident memory of this process and its descendants (the engine's)."""

from __future__ import annotations

import os


def visible_handles(pynvml) -> list:
    """NVML handles of the GPUs CUDA_VISIBLE_DEVICES leaves this process (indices or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = pynvml.nvmlDeviceGetCount()
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    out = []
    for g in (x.strip() for x in visible.split(",") if x.strip()):
        try:
            out.append(pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit()
                       else pynvml.nvmlDeviceGetHandleByUUID(g))
        except Exception:
            continue
    return out


class DeviceProbe:
    """A snapshot source: {"device_memory_bytes", "gpu_utilization"} (the latter on GPUs only)."""

    def __init__(self):
        self._nvml = None
        try:
            from vx.device import cuda_available

            if cuda_available():
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = visible_handles(pynvml)
        except Exception:
            self._nvml = None

    def __call__(self) -> dict:
        if self._nvml is not None and self._handles:
            n = self._nvml
            used = sum(n.nvmlDeviceGetMemoryInfo(h).used for h in self._handles)
            util = sum(n.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles) / len(self._handles)
            return {"device_memory_bytes": int(used), "gpu_utilization": round(util / 100, 3)}
        return {"device_memory_bytes": tree_rss(os.getpid())}


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total
