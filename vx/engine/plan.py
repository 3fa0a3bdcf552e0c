"""The capture engine's memory plan, made by vLLM's own planner before any weight loads.

vLLM gives vx's hidden-state group (K only: L x H x 2 bytes per token) the largest block that
divides every other group's block and fits the common page (`get_kv_cache_groups`, 0.32
`v1/core/kv_cache_utils.py`, 0.33 `v1/core/kv_cache_planning.py`). On a hybrid GDN model the
attention block is aligned up to the GDN state page (`Platform._align_hybrid_block_size`: 784
tokens for a Qwen3.6-27B-class target on a GPU) and each GDN group's block is max_model_len
(without prefix caching), so a max_model_len of "longest sample + 1" makes that divisor 1 for most
lengths: one captured token per block. vLLM bills every block at the widest group's pages (16
layers' for 27B, ~51 MB a block) unless vx's change to it (vx/engine/patches/hidden_state_billing.py,
active in vx's engines) makes every group one layer wide (one page a block). `plan_engine` rounds max_model_len up to a multiple of the best block the
attention block allows, then builds the KV cache specs vLLM's layers would build and runs vLLM's
grouping and per-block billing over them: the block sizes, the bytes billed per captured token
and, given the memory, the blocks and the tokens in flight. vLLM then re-plans the same way as
it starts; the engine's log line `Using block size N for hidden-state cache layer` shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# On a GPU vLLM's attention backends (FlashAttention, FlashInfer, Triton) take kernel blocks in
# multiples of 16 and its default block is 16 (0.32 and 0.33): the attention block of a hybrid
# model is 16 x cdiv(GDN page, 16 x one token's attention page) (_align_hybrid_block_size).
GPU_KERNEL_BLOCK = 16
MIN_HIDDEN_BLOCK = 16  # below this the capture's blocks cost more than they hold (issue 51)


@dataclass
class EnginePlan:
    max_model_len: int
    attention_block: int            # tokens per block of the full-attention group(s)
    hidden_block: int               # tokens per block of vx's hidden-state group
    hidden_bytes_per_token: int     # L x H x dtype
    bytes_per_block: int            # what vLLM bills every block, whichever group takes it
    groups: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, layers, block tokens)
    hybrid: bool = False
    gdn_spare_blocks: int = 0       # per request and GDN group: extract_hidden_states' num_speculative_blocks
    num_blocks: int | None = None   # with available_bytes given
    available_bytes: int | None = None

    @property
    def widest_group(self) -> int:
        """Layers of the widest KV group: the pages vLLM bills each block, the hidden state's included."""
        return max((n for _, n, _ in self.groups), default=1)

    @property
    def billed_bytes_per_token(self) -> float:
        """Memory one captured token costs: its share of a hidden-state block."""
        return self.bytes_per_block / self.hidden_block

    def blocks_for(self, tokens: int) -> int:
        """Blocks one request of this many tokens holds at once (every group's)."""
        n = 0
        for kind, _, bs in self.groups:  # GDN: one state block per request, + the method's spare ones
            n += 1 + self.gdn_spare_blocks if kind == "gdn" else -(-tokens // bs)
        return n

    def requests_in_flight(self, tokens: int) -> int | None:
        """How many requests of this length the blocks hold at once."""
        if self.num_blocks is None:
            return None
        return max(0, (self.num_blocks - 1) // self.blocks_for(tokens))  # block 0: vLLM's null block

    def line(self, mean_tokens: int | None = None) -> str:
        s = (f"max_model_len {self.max_model_len:,}; blocks: attention {self.attention_block}, hidden states "
             f"{self.hidden_block} tokens; {self.bytes_per_block / 2**20:,.1f} MiB billed per block, "
             f"{self.billed_bytes_per_token / 2**10:,.0f} KiB per captured token "
             f"({self.billed_bytes_per_token / self.hidden_bytes_per_token:,.1f}x its {self.hidden_bytes_per_token:,} B)")
        if self.num_blocks is not None:
            s += (f"; {self.num_blocks:,} blocks hold {self.requests_in_flight(self.max_model_len):,} requests "
                  f"of max_model_len")
            if mean_tokens:
                s += f" or {self.requests_in_flight(mean_tokens):,} of {mean_tokens:,} tokens"
        if self.hybrid and self.widest_group > 1:
            s += (f"; vLLM bills each hidden-state block at the widest group's {self.widest_group} pages "
                  f"(vx's change hidden_state_billing is not active in this engine)")
        return s


def _planning():
    """vLLM's planner functions, with vx's changes to them (vx/engine/patches/: the plan of vx's
    engine, which has them): 0.33 moved them to kv_cache_planning."""
    from vx.engine import patches

    patches.install()
    try:
        from vllm.v1.core import kv_cache_planning as p  # 0.33
    except ImportError:
        from vllm.v1.core import kv_cache_utils as p  # 0.32
    return p


def round_max_model_len(max_model_len: int, hidden_block: int) -> int:
    """max_model_len rounded up to a multiple of the hidden block, so that gcd(attention block,
    GDN block = max_model_len) keeps it: the cost is nothing (GDN holds one state per request)."""
    return -(-max_model_len // hidden_block) * hidden_block


def kv_cache_specs(vllm_config, layer_count: int, hidden: int, attention_block: int) -> tuple[dict, bool]:
    """The KV cache specs vLLM's layers build for this model and vx's capture (attention, GDN
    state, the cache-only hidden-state layer), from the config alone, and whether it is hybrid."""
    import torch
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec, MambaSpec

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    text = mc.hf_text_config
    n = int(text.num_hidden_layers)
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    dtype = mc.dtype if cc.cache_dtype == "auto" else getattr(torch, cc.cache_dtype, mc.dtype)
    specs: dict = {}
    hybrid = "linear_attention" in kinds
    if hybrid:
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
        gdn = MambaSpec(shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                        block_size=cc.mamba_block_size or mc.max_model_len, mamba_cache_mode="none",
                        num_speculative_blocks=vllm_config.num_speculative_tokens)
        attention_page = FullAttentionSpec(block_size=attention_block, num_kv_heads=mc.get_num_kv_heads(pc),
                                           head_size=mc.get_head_size(), dtype=dtype).page_size_bytes
        gdn = replace(gdn, page_size_padded=attention_page)
    for i, kind in enumerate(kinds):
        if kind == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = gdn
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=attention_block, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
                dtype=dtype)
    specs["cache_only_layers.capture"] = HiddenStateCacheSpec(block_size=attention_block, num_kv_heads=layer_count,
                                                              head_size=hidden, dtype=dtype)
    return specs, hybrid


def align_for_platform(vllm_config) -> None:
    """What vLLM's executor does before the model loads (`update_block_size_for_backend`): align a
    hybrid model's attention block up to the GDN state page for this platform's attention backend,
    chosen by vLLM's selector (the executor finds it on the built model's layers)."""
    if not _is_hybrid(vllm_config) or getattr(vllm_config.cache_config, "mamba_page_size_padded", None):
        return
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(mc.get_head_size(), mc.dtype, cc.cache_dtype)
    current_platform._align_hybrid_block_size(vllm_config, backend)


def plan_config(vllm_config, layer_count: int, hidden: int, available_bytes: int | None = None,
                attention_block: int | None = None) -> EnginePlan:
    """vLLM's grouping and billing over the specs of this config (max_model_len as it is)."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MambaSpec

    p = _planning()
    _assume_layout(vllm_config)
    if attention_block is None:
        align_for_platform(vllm_config)
    block = attention_block or vllm_config.cache_config.block_size
    specs, hybrid = kv_cache_specs(vllm_config, layer_count, hidden, block)
    groups = p.get_kv_cache_groups(vllm_config, specs)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    per_block = p._get_kv_cache_bytes_per_block(groups, layout)
    kinds, hidden_block, attention, spare = [], None, block, 0
    for g in groups:
        s = g.kv_cache_spec
        if "cache_only_layers.capture" in g.layer_names and (isinstance(s, HiddenStateCacheSpec) or len(g.layer_names) == 1):
            hidden_block = s.block_size
            kinds.append(("hidden", 1, s.block_size))
        elif isinstance(s, MambaSpec):
            kinds.append(("gdn", len(g.layer_names), s.block_size))
            spare = s.num_speculative_blocks
        else:  # attention; on a dense model the capture layer can share its group (one block size)
            attention = s.block_size
            if "cache_only_layers.capture" in g.layer_names:
                hidden_block = s.block_size
            kinds.append(("attention", len(g.layer_names), s.block_size))
    num_blocks = None if available_bytes is None else max(0, int(available_bytes // per_block))
    return EnginePlan(max_model_len=vllm_config.model_config.max_model_len, attention_block=attention,
                      hidden_block=hidden_block or 1, hidden_bytes_per_token=layer_count * hidden * 2,
                      bytes_per_block=int(per_block), groups=kinds, hybrid=hybrid, gdn_spare_blocks=spare,
                      num_blocks=num_blocks,
                      available_bytes=available_bytes)


def _assume_layout(vllm_config) -> None:
    """The engine core resolves the KV layout from its workers' backends; a plan made before
    assumes the layer-outer one (NHD) that vLLM's CPU and FlashAttention backends prefer."""
    if vllm_config.cache_config.kv_cache_layout is None:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(vllm_config.cache_config, "LBNHC")


def plan_engine(vllm_config, layer_count: int, hidden: int, available_bytes: int | None = None,
                attention_block: int | None = None, round_up: bool = True) -> EnginePlan:
    """The plan with max_model_len rounded up so the hidden-state block is the best vLLM allows.
    vllm_config: from `EngineArgs(**kwargs).create_engine_config()` on this machine (its platform
    set the attention block), or with attention_block given (a GPU's, planned elsewhere)."""
    wanted = vllm_config.model_config.max_model_len
    if round_up and _is_hybrid(vllm_config):
        # first with every group's block a multiple of the attention block: vLLM's rule then gives
        # the best hidden block there is (and its log line says so; no worse line is ever logged)
        _set_max_model_len(vllm_config, round_max_model_len(wanted, attention_block or vllm_config.cache_config.block_size))
        best = plan_config(vllm_config, layer_count, hidden, available_bytes, attention_block).hidden_block
        _set_max_model_len(vllm_config, round_max_model_len(wanted, best))  # the least rounding that keeps it
    return plan_config(vllm_config, layer_count, hidden, available_bytes, attention_block)


def _is_hybrid(vllm_config) -> bool:
    return "linear_attention" in (getattr(vllm_config.model_config.hf_text_config, "layer_types", None) or [])


def _set_max_model_len(vllm_config, mml: int) -> None:
    """What vLLM derives from max_model_len for this plan: the GDN group's block (prefix caching off)."""
    vllm_config.model_config.max_model_len = mml
    vllm_config.cache_config.mamba_block_size = mml


def gpu_attention_block(vllm_config, kernel_block: int = GPU_KERNEL_BLOCK) -> int:
    """The attention block vLLM sets on a GPU for a hybrid model (_align_hybrid_block_size's
    arithmetic, over vLLM's own page sizes), for plans made on another machine."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    one = FullAttentionSpec(block_size=1, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
                            dtype=mc.dtype).page_size_bytes
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    if not hasattr(model_cls, "get_mamba_state_shape_from_config"):
        return kernel_block
    gdn = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config), block_size=-1).page_size_bytes
    return kernel_block * math.ceil(gdn / (kernel_block * one))
