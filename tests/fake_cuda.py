"""Make torch answer like a CUDA machine with N GPUs to the questions vx asks before it starts an
engine, and record every question that, on a real CUDA build, initialises CUDA in this process
(after which a forked child dies on its first CUDA call).

On a CUDA build, `torch.cuda.is_available()` asks NVML when PYTORCH_NVML_BASED_CUDA_CHECK=1 (no
CUDA initialisation) and the CUDA runtime otherwise (`cudaGetDeviceCount` runs cuInit: forks are
poisoned); `torch.cuda.device_count()` asks NVML; `init`, `current_device`, `get_device_name`,
`get_device_properties`, `mem_get_info` and `set_device` initialise CUDA. Call `install(n)` in a
subprocess before importing the code under test; `POISONED` lists the poisoning calls with
where they came from.
"""

from __future__ import annotations

import os
import traceback

POISONED: list[str] = []
INITIALISING = ("init", "current_device", "get_device_name", "get_device_properties", "mem_get_info",
                "set_device", "get_device_capability", "synchronize")


def _record(what: str) -> None:
    POISONED.append(what + "\n" + "".join(traceback.format_stack(limit=10)[:-2]))


def install(gpus: int = 8) -> None:
    import torch

    def visible() -> int:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        return gpus if env is None else len([v for v in env.split(",") if v.strip()])

    def is_available() -> bool:
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
            _record("torch.cuda.is_available() without PYTORCH_NVML_BASED_CUDA_CHECK=1 (cudaGetDeviceCount)")
        return visible() > 0

    def initialising(name):
        def call(*args, **kwargs):
            _record(f"torch.cuda.{name}()")
            raise RuntimeError(f"fake_cuda: torch.cuda.{name}() would initialise CUDA")
        return call

    torch.cuda.is_available = is_available
    torch.cuda.device_count = visible
    for name in INITIALISING:
        setattr(torch.cuda, name, initialising(name))


class _Stop(BaseException):
    """Raised by the probe standing in for vllm.LLM: the run ends where the engine would start."""


def _probe(*args, **kwargs):
    """Stands in for vllm.LLM: reports what the engine would start with, then stops the run."""
    import json
    import sys

    from vllm.utils.system_utils import get_mp_context

    rec = {"nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
           "start_method": get_mp_context().get_start_method(), "poisoned": list(POISONED),
           "engine_kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))}}
    print("PROBE " + json.dumps(rec), file=sys.__stdout__, flush=True)
    raise _Stop()


def _patch_llm_on_import() -> None:
    """vllm is imported where vx imports it (its own import sets the NVML check, so importing it
    here first would hide a poisoning call); its LLM becomes the probe then."""
    import importlib.abc
    import importlib.util
    import sys

    class PatchLLM(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm":
                return None
            sys.meta_path.remove(self)  # a bare find_spec (is vllm installed?) must not disarm it
            try:
                spec = importlib.util.find_spec("vllm")
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                run(module)
                module.LLM = _probe

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchLLM())


if __name__ == "__main__":
    # python tests/fake_cuda.py cli ARGS...     : the vx command, up to its engine's start
    # python tests/fake_cuda.py worker CONFIG  : a launcher's partition worker (python -m vx.launch.worker extract)
    # python tests/fake_cuda.py slots CONFIG   : the launcher's engine slots for an ExtractConfig
    import json
    import sys

    install(int(os.environ.get("FAKE_CUDA_GPUS", "8")))
    _patch_llm_on_import()
    mode, args = sys.argv[1], sys.argv[2:]
    try:
        if mode == "cli":
            from vx.cli import main

            main(args)
        elif mode == "worker":
            from vx.launch.worker import main as worker_main

            worker_main(["extract", *args])
        elif mode == "slots":
            from vx.jobs.config import ExtractConfig
            from vx.errors import UsageError
            from vx.launch.workers import worker_slots

            try:
                slots = worker_slots(ExtractConfig(**json.loads(args[0])))
            except UsageError as e:
                print(f"USAGE {e}", flush=True)
            else:
                print("SLOTS " + json.dumps({"slots": slots, "poisoned": POISONED}), flush=True)
    except _Stop:
        pass
