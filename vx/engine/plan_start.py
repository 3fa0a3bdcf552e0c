"""The capture engine's plan at its start (vx/engine/plan.py makes it): the driver's plan before the
engine starts, the one-line refusal where one request of max_model_len cannot fit beside the
weights, the one-pass mode's split of one GPU between its two engines, and `vx selftest --model`'s
line for the real target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vx.engine.budget import Budget, choose_budget, device_step
from vx.engine.plan import EnginePlan, plan_engine

# Per engine, beside its weights and KV cache: activations at a full step, CUDA graphs, NCCL and the
# CUDA context. An estimate (vLLM measures its own as it starts and fails there if it was short).
GPU_RESERVE = 4 * 10**9
PLANNED_LENGTH = 4096  # the longest sample `vx selftest` plans a real target's engine for
MEAN_SAMPLE = 335      # the tokens of an average chat sample (the line's in-flight figure)

def check_fits(plan: EnginePlan, tensor_parallel_size: int) -> None:
    """Stop before any weight loads, in one line, where vLLM cannot place even one request of
    max_model_len in the memory left beside the weights (so no activation estimate can rescue it)."""
    from vx.errors import UsageError

    if plan.available_bytes is None:
        return
    blocks = plan.available_bytes // plan.bytes_per_block
    need = plan.blocks_for(plan.max_model_len) + 1  # + vLLM's null block
    if blocks < need:
        raise UsageError(
            f"the capture engine cannot start: one request of max_model_len {plan.max_model_len:,} needs {need:,} "
            f"KV blocks of {plan.bytes_per_block / 2**20:,.0f} MiB (hidden-state block {plan.hidden_block} tokens) "
            f"and at most {blocks:,} fit beside the weights; lower --max-model-len (or --max-length), raise "
            f"--tensor-parallel-size (now {tensor_parallel_size}) or --gpu-memory-utilization, or capture fewer --layers")


@dataclass
class GpuSplit:
    regeneration: float  # each engine's --gpu-memory-utilization, summing to the user's
    capture: float
    line: str


def split_gpu(total: float, utilization: float, weight_bytes: float, plan: EnginePlan, step_tokens: int,
              mean_tokens: int = MEAN_SAMPLE, tensor_parallel_size: int = 1) -> GpuSplit:
    """One GPU's --gpu-memory-utilization shared by the one-pass mode's two engines, each holding a
    copy of the weights (weight_bytes: this rank's share): the capture gets the KV blocks its plan
    needs to keep a full step in flight (the step's requests, and the previous step's, which async
    scheduling frees only after this one was scheduled), at least one request of max_model_len and
    at most half the room;
    the generation the rest, at least one request of max_model_len. Raises UsageError, in one line,
    where the two cannot both start."""
    from vx.errors import UsageError

    per_engine = weight_bytes + GPU_RESERVE
    room = total * utilization - 2 * per_engine
    one = (plan.blocks_for(plan.max_model_len) + 1) * plan.bytes_per_block  # + vLLM's null block
    requests = 2 * math.ceil(step_tokens / mean_tokens)
    full = (requests * plan.blocks_for(mean_tokens) + 1) * plan.bytes_per_block
    capture_kv = max(one, min(full, room / 2))
    if room - capture_kv < one:
        raise UsageError(
            f"--regenerate runs two engines on each GPU, each with the weights ({weight_bytes / 1e9:,.1f} GB per GPU) "
            f"and {GPU_RESERVE / 1e9:,.0f} GB for activations: at --gpu-memory-utilization {utilization} of "
            f"{total / 1e9:,.0f} GB they leave {max(room, 0) / 1e9:,.1f} GB, and each needs "
            f"{one / 1e9:,.1f} GB for one request of max_model_len {plan.max_model_len:,}; raise "
            f"--tensor-parallel-size (now {tensor_parallel_size}) or --gpu-memory-utilization, lower --max-model-len, "
            f"or run `vx regenerate` and `vx extract` one after the other")
    thousandths = (per_engine + capture_kv) / total * 1000  # the capture's share, rounded up unless
    capture = math.ceil(thousandths) / 1000                 # the generation's request no longer fits
    if (utilization - capture) * total - per_engine < one:
        capture = math.floor(thousandths) / 1000
    regeneration = math.floor((utilization - capture) * 1000) / 1000
    line = (f"one GPU, two engines: --gpu-memory-utilization {utilization} split as regeneration {regeneration}, "
            f"capture {capture} (weights {weight_bytes / 1e9:,.1f} GB each; capture KV {capture_kv / 1e9:,.1f} GB: "
            f"{(capture_kv // plan.bytes_per_block - 1) // plan.blocks_for(mean_tokens):,.0f} requests of {mean_tokens} "
            f"tokens in flight, of the {requests:,} two full {step_tokens:,}-token steps hold)")
    return GpuSplit(regeneration, capture, line)


def gpu_shares(model: str, layers, max_model_len: int, utilization: float | None, tensor_parallel_size: int,
               step_tokens: int | None) -> tuple[float, float] | None:
    """The one-pass mode's (regeneration, capture) --gpu-memory-utilization: split_gpu (of 0.9 where
    none is given) for the capture engine the driver will start, from its plan (vLLM's own config
    and planner, no weights) and this GPU's memory, its line on stderr; None off an NVML-visible GPU."""
    import sys
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs

    from vx.data.layers import resolve_layer_ids
    from vx.data.model import model_info, resolve_model
    from vx.engine.vllm_engine import engine_kwargs

    total = _gpu_total_bytes()
    if total is None:
        return None
    utilization = utilization or 0.9
    model_dir = resolve_model(model)
    layer_ids = resolve_layer_ids(layers, model_info(model_dir).num_layers)
    kwargs = engine_kwargs(Path(model_dir), layer_ids, on_cpu=False, max_model_len=max_model_len,
                           gpu_memory_utilization=utilization, tensor_parallel_size=tensor_parallel_size)
    config = EngineArgs(**kwargs).create_engine_config()
    plan = plan_engine(config, len(layer_ids), int(config.model_config.hf_text_config.hidden_size))
    weights = weight_bytes(model_dir) / tensor_parallel_size
    split = split_gpu(total, utilization, weights, plan,
                      step_tokens or device_step(False, total, _gpu_name()), MEAN_SAMPLE, tensor_parallel_size)
    print(f"vx: {split.line}", file=sys.stderr)
    return split.regeneration, split.capture


def weight_bytes(model_dir) -> int:
    """The checkpoint's weights on disk (every rank's together)."""
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _gpu_total_bytes() -> int | None:
    """This GPU's memory, or None off an NVML-visible GPU (asked through NVML: the query must not
    initialise CUDA before vLLM forks)."""
    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "NvmlCudaPlatform":
        return None
    return current_platform.get_device_total_memory(0)


def _gpu_bytes_beside_weights(config, model_dir) -> int | None:
    """A GPU's memory at the engine's utilization less this rank's share of the weights, or None
    off an NVML-visible GPU."""
    total = _gpu_total_bytes()
    if total is None:
        return None
    weights = weight_bytes(model_dir)
    tp = config.parallel_config.tensor_parallel_size
    return int(total * config.cache_config.gpu_memory_utilization - weights / tp)


def plan_capture_engine(kwargs: dict, layer_count: int, lengths=None, step: int | None = None,
                        seqs: int | None = None) -> tuple[dict, EnginePlan | None, Budget | None]:
    """The capture engine's arguments with max_model_len rounded by the plan and the step budget
    chosen from it (vx/engine/budget.py; `step`/`seqs`: the user's, kept), the plan and the
    budget: run in the driver before the engine starts (vLLM's own config and platform: ~1 s), so
    the engine vLLM then builds gets the same groups. `lengths`: the token counts of the samples
    the run submits, in order (None: unknown). The model's own limit is kept: a rounding past it
    is not made. A config vLLM rejects is left for the engine to report."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        config = EngineArgs(**kwargs).create_engine_config()
    except Exception:  # the engine's start says why, in its log, as before
        return kwargs, None, None
    wanted = config.model_config.max_model_len
    plan = plan_engine(config, layer_count, int(config.model_config.hf_text_config.hidden_size),
                       _gpu_bytes_beside_weights(config, kwargs["model"]))
    limit = getattr(config.model_config.hf_text_config, "max_position_embeddings", None)
    if plan.max_model_len != wanted and (not limit or plan.max_model_len <= limit):
        kwargs = dict(kwargs, max_model_len=plan.max_model_len)
    check_fits(plan, config.parallel_config.tensor_parallel_size)
    on_cpu = config.device_config.device_type == "cpu"
    budget = _budget(config, plan, lengths, step, seqs, on_cpu, kwargs.get("kv_cache_memory_bytes"))
    kwargs = dict(kwargs, max_num_batched_tokens=budget.step_tokens, max_num_seqs=budget.max_num_seqs)
    plan.num_blocks = None  # the engine's own count replaces the estimate once it starts
    return kwargs, plan, budget


def _budget(config, plan: EnginePlan, lengths, step: int | None, seqs: int | None, on_cpu: bool,
            cpu_kv_bytes: int | None) -> Budget:
    """The step budget over the blocks the engine will have: on a GPU what the plan finds beside
    the weights less GPU_RESERVE for activations, on CPU the KV cache vx sizes (else unknown)."""
    kv_bytes = cpu_kv_bytes if on_cpu else (None if plan.available_bytes is None else plan.available_bytes - GPU_RESERVE)
    sized = replace(plan, num_blocks=None if kv_bytes is None else int(kv_bytes // plan.bytes_per_block))
    total = None if on_cpu else _gpu_total_bytes()
    return choose_budget(sized, lengths, device_step(on_cpu, total, _gpu_name() if total else ""),
                         bool(config.scheduler_config.async_scheduling), step, seqs, profiled=not on_cpu)


def _gpu_name() -> str:
    from vllm.platforms import current_platform

    try:
        return current_platform.get_device_name(0)
    except Exception:
        return ""


def describe_target(model: str, tensor_parallel_size: int, on_cpu: bool) -> str:
    """One line for `vx selftest --model`: the capture engine's plan for the real target (its
    config only, no weights) and DFlash's layers, with this GPU's memory: blocks, billed bytes per
    captured token, requests in flight, or why the engine would not start."""
    from vllm.engine.arg_utils import EngineArgs

    from vx.data.layers import default_layer_ids
    from vx.data.model import model_info, resolve_model
    from vx.engine.vllm_engine import engine_kwargs
    from vx.errors import UsageError

    model_dir = resolve_model(model)
    layer_count = len(default_layer_ids(model_info(model_dir).num_layers))

    kwargs = engine_kwargs(model_dir, list(range(layer_count)), on_cpu=on_cpu, max_model_len=PLANNED_LENGTH,
                           tensor_parallel_size=tensor_parallel_size)
    config = EngineArgs(**kwargs).create_engine_config()
    plan = plan_engine(config, layer_count, int(config.model_config.hf_text_config.hidden_size),
                       _gpu_bytes_beside_weights(config, model_dir))
    where = "" if plan.available_bytes is None else f" ({plan.available_bytes / 1e9:,.1f} GB beside the weights)"
    try:
        check_fits(plan, tensor_parallel_size)
    except UsageError as e:
        return f"{layer_count} layers, TP {tensor_parallel_size}, samples up to {PLANNED_LENGTH:,} tokens{where}: " \
               f"WOULD NOT START: {e}"
    budget = _budget(config, plan, None, None, None, on_cpu, kwargs.get("kv_cache_memory_bytes"))
    return f"{layer_count} layers, TP {tensor_parallel_size}, samples up to {PLANNED_LENGTH:,} tokens{where}: " \
           f"{plan.line(MEAN_SAMPLE)}; {budget.line}"
