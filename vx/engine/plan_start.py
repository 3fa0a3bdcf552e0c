"""The capture engine's plan at its start (vx/engine/plan.py makes it): the driver's plan before the
engine starts, the one-line refusal where one request of max_model_len cannot fit beside the
weights, and `vx selftest --model`'s line for the real target.
"""

from __future__ import annotations

from vx.engine.plan import EnginePlan, plan_engine

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


def _gpu_bytes_beside_weights(config, model_dir) -> int | None:
    """A GPU's memory at the engine's utilization less this rank's share of the weights, or None
    off an NVML-visible GPU (the query must not initialise CUDA before vLLM forks)."""
    from pathlib import Path

    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "NvmlCudaPlatform":
        return None
    total = current_platform.get_device_total_memory(0)
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    tp = config.parallel_config.tensor_parallel_size
    return int(total * config.cache_config.gpu_memory_utilization - weights / tp)


def plan_capture_engine(kwargs: dict, layer_count: int) -> tuple[dict, EnginePlan | None]:
    """The capture engine's arguments with max_model_len rounded by the plan, and the plan: run
    in the driver before the engine starts (vLLM's own config and platform: ~1 s), so the engine
    vLLM then builds gets the same groups. The model's own limit is kept: a rounding past it is
    not made. A config vLLM rejects is left for the engine to report."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        config = EngineArgs(**kwargs).create_engine_config()
    except Exception:  # the engine's start says why, in its log, as before
        return kwargs, None
    wanted = config.model_config.max_model_len
    plan = plan_engine(config, layer_count, int(config.model_config.hf_text_config.hidden_size),
                       _gpu_bytes_beside_weights(config, kwargs["model"]))
    limit = getattr(config.model_config.hf_text_config, "max_position_embeddings", None)
    if plan.max_model_len != wanted and (not limit or plan.max_model_len <= limit):
        kwargs = dict(kwargs, max_model_len=plan.max_model_len)
    check_fits(plan, config.parallel_config.tensor_parallel_size)
    plan.num_blocks = None  # the engine's own count replaces the estimate once it starts
    return kwargs, plan


PLANNED_LENGTH = 4096  # the longest sample `vx selftest` plans a real target's engine for
MEAN_SAMPLE = 335      # the tokens of an average chat sample (the line's in-flight figure)


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
    return f"{layer_count} layers, TP {tensor_parallel_size}, samples up to {PLANNED_LENGTH:,} tokens{where}: " \
           f"{plan.line(MEAN_SAMPLE)}"
