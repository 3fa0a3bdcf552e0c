"""GPU engine defaults, from the memory arithmetic of extraction (README "Backends: cost").

Per token, the engine keeps its attention KV plus, for vx, the cache-only hidden-state group:
L x H x 2 bytes (5 x 5120 x 2 = 51,200 B for a 27B target). Per running request, a hybrid GDN
model keeps one recurrent + conv state per GDN layer, and the extract_hidden_states method
reserves one more state block per request (num_speculative_blocks = 1), so twice that.
`plan_memory` does the sum; the defaults below are what it gives for a Qwen3.6-27B-class target
on one 141 GB H200 at 0.9 utilisation (tested in tests/test_vllm_contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NUM_BATCHED_TOKENS = 8192  # a full prefill step: ~25 average (335-token) samples
MAX_NUM_SEQS = 128             # in flight: 2x what one full step finishes, GDN state still fits


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
