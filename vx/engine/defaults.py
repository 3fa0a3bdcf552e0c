"""GPU engine defaults, from the memory arithmetic of extraction (docs/backends.md, cost of capture).

Per token, the engine keeps its attention KV plus, for vx, the cache-only hidden-state group:
L x H x 2 bytes (5 x 5120 x 2 = 51,200 B for a 27B target). Per running request, a hybrid GDN
model keeps one recurrent + conv state per GDN layer, and the extract_hidden_states method
reserves one more state block per request (num_speculative_blocks = 1), so twice that.
`plan_memory` does the sum; the defaults below are what it gives for a Qwen3.6-27B-class target
on one 141 GB H200 at 0.9 utilisation (tested in tests/test_vllm_contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# engine_kwargs' GPU step and count where none is given: the capture engine replaces them with the
# budget chosen from its plan and the run's lengths (vx/engine/budget.py); `vx selftest` keeps this step
MAX_NUM_BATCHED_TOKENS = 8192  # a full prefill step: ~25 average (335-token) samples
MAX_NUM_SEQS = 128             # in flight: 2x what one full step finishes, GDN state still fits
# On CPU: vLLM's default step is 4,096 tokens. The extract_hidden_states method adds a fixed cost
# per step (its proposer, the cache-only writes), which 4k-token steps of a small model do not
# amortise: vx measured 0.86x bare vLLM prefill at 4k and 0.99x at 16k (bench/throughput.py --step)
CPU_MAX_NUM_BATCHED_TOKENS = 16384


# On CPU vLLM gives KV the fraction of host memory vx sets (0.3: 5.9 GiB on a 24 GiB machine) and
# zero-fills it as the engine starts: ~9 s of a 2-core engine's start, and the capture itself ran 7.5 s
# against 4.4 s with 1 GiB (first touches; bench model, 128 conversations). vx sizes it to the job
# instead: this many tokens of max_model_len per GiB, at least 1 GiB. The costliest model vx runs per
# token (the bench's tiny hybrid, whose hidden-state page is padded to the GDN state's) holds ~4,000
# tokens per GiB: two max-length requests. VLLM_CPU_KVCACHE_SPACE or --gpu-memory-utilization win.
CPU_KV_TOKENS_PER_GIB = 2048
GIB = 1 << 30


def cpu_kv_cache_bytes(max_model_len: int | None) -> int | None:
    """The KV cache vx gives a CPU engine, or None for vLLM's own sizing: no max_model_len known,
    VLLM_CPU_KVCACHE_SPACE set, or more than vLLM's would be (0.3 of host memory)."""
    import os

    if not max_model_len or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    want = max(1, -(-max_model_len // CPU_KV_TOKENS_PER_GIB)) * GIB
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return want if want <= 0.3 * host else None


def memory_kwargs(on_cpu: bool, gpu_memory_utilization: float | None, max_model_len: int | None) -> dict:
    """The engine's memory arguments, for both of vx's engines: --gpu-memory-utilization wins; else
    0.9 of a GPU, or on CPU a KV cache sized to the job (0.3 of host memory where vLLM sizes it)."""
    if gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    if not on_cpu:
        return {"gpu_memory_utilization": 0.9}
    kv_bytes = cpu_kv_cache_bytes(max_model_len)
    return {"gpu_memory_utilization": 0.3, **({"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {})}


def default_budget(max_num_batched_tokens: int | None, max_num_seqs: int | None) -> tuple[int, int]:
    return max_num_batched_tokens or MAX_NUM_BATCHED_TOKENS, max_num_seqs or MAX_NUM_SEQS


@dataclass
class MemoryPlan:
    kv_bytes_per_token: int        # attention KV, all full-attention layers
    states_bytes_per_token: int    # vx's cache-only hidden-state group
    gdn_bytes_per_request: int     # recurrent + conv state of every GDN layer, x2 (spec block)
    free_bytes: int                # for KV and states after weights and activations
    max_tokens: int                # tokens of KV + states that fit beside max_num_seqs requests' GDN state
    max_tokens_without_states: int

    @property
    def states_overhead(self) -> float:
        return self.states_bytes_per_token / self.kv_bytes_per_token


def plan_memory(*, gpu_bytes: float, utilization: float, weight_bytes: float, activation_bytes: float,
                full_attention_layers: int, kv_heads: int, head_dim: int, gdn_layers: int, gdn_k_heads: int,
                gdn_v_heads: int, gdn_k_dim: int, gdn_v_dim: int, conv_kernel: int, capture_layers: int,
                hidden: int, max_num_seqs: int, dtype_bytes: int = 2, ssm_state_bytes: int = 4) -> MemoryPlan:
    kv = full_attention_layers * 2 * kv_heads * head_dim * dtype_bytes
    states = capture_layers * hidden * dtype_bytes
    recurrent = gdn_v_heads * gdn_k_dim * gdn_v_dim * ssm_state_bytes  # vLLM keeps it in fp32 for Qwen3.5
    conv = (2 * gdn_k_heads * gdn_k_dim + gdn_v_heads * gdn_v_dim) * (conv_kernel - 1) * dtype_bytes
    gdn = gdn_layers * (recurrent + conv) * 2
    free = gpu_bytes * utilization - weight_bytes - activation_bytes
    left = free - max_num_seqs * gdn
    return MemoryPlan(kv, states, gdn, int(free), int(left // (kv + states)), int(left // kv))


def page_check(config: dict, tensor_parallel_size: int, capture_layers: int, dtype_bytes: int = 2,
               block_size: int = 16) -> dict:
    """vLLM issue #51016: with tensor parallelism the KV page of each rank shrinks (KV heads / TP)
    while the hidden-state cache's per-token cost (capture_layers x hidden, never sharded) does
    not; a page smaller than one token's states failed an assertion at engine start until vLLM
    scaled the block sizes up (PR #50894, `_ensure_min_page_size`, in 0.32 and 0.33). From the
    model's config (text_config for VL checkpoints): the per-rank common page and the per-token
    state cost. Hybrid GDN models align the attention page to the GDN state page, far larger."""
    text = config.get("text_config") or config
    tp = tensor_parallel_size
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_key_value_heads") or text.get("num_attention_heads", 1))
    head_dim = int(text.get("head_dim") or hidden // int(text.get("num_attention_heads", 1)))
    attention = block_size * 2 * max(1, heads // tp) * head_dim * dtype_bytes
    gdn = 0
    if "linear_attention" in (text.get("layer_types") or []):
        v_heads = max(1, int(text["linear_num_value_heads"]) // tp)
        k_heads = max(1, int(text["linear_num_key_heads"]) // tp)
        k_dim, v_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        conv = (2 * k_heads * k_dim + v_heads * v_dim) * (int(text.get("linear_conv_kernel_dim", 4)) - 1)
        gdn = v_heads * k_dim * v_dim * 4 + conv * dtype_bytes
    page = max(attention, gdn)
    states = capture_layers * hidden * dtype_bytes
    return {"tensor_parallel_size": tp, "page_bytes": page, "state_bytes_per_token": states,
            "exposed": states > page}


def vllm_scales_pages() -> bool:
    """Whether the installed vLLM scales KV pages up to the hidden-state cost (the #51016 fix)."""
    import importlib

    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            if hasattr(importlib.import_module(module), "_ensure_min_page_size"):
                return True
        except ImportError:
            continue
    return False


def check_tensor_parallel_pages(model_dir, tensor_parallel_size: int, capture_layers: int, dtype_bytes: int = 2):
    """Stop before any weight loads, with one line, where vLLM #51016 would fail the engine."""
    import json
    from pathlib import Path

    from vx.errors import UsageError

    if tensor_parallel_size <= 1:
        return None
    check = page_check(json.loads((Path(model_dir) / "config.json").read_text()), tensor_parallel_size,
                       capture_layers, dtype_bytes)
    if check["exposed"] and not vllm_scales_pages():
        raise UsageError(
            f"at --tensor-parallel-size {tensor_parallel_size} each rank's KV page ({check['page_bytes']:,} B) is "
            f"smaller than one token's captured states ({check['state_bytes_per_token']:,} B), which this vLLM "
            "cannot place (vLLM issue #51016, fixed by PR #50894): use a smaller tensor-parallel size, fewer "
            "--layers, or a vLLM with the fix")
    return check
