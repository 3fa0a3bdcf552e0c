"""The capture engine's memory plan (vx/engine/plan.py), run by vLLM's own planner over the configs
of real targets (config values only: no weights), for the GPUs users run them on.

The expected figures are worked out here from the config values with vLLM's rules as its source
states them (0.32 `_align_hybrid_block_size`, `get_kv_cache_groups`, `_get_kv_cache_bytes_per_block`),
not read from the plan: the GDN state page (fp32 recurrent state, as the checkpoints ask through
`mamba_ssm_dtype`, and a conv state one token longer for the extract_hidden_states method), the
attention block aligned up to it in 16-token kernel blocks, the hidden-state block the largest
divisor of it that fits the page, and, with vx's change hidden_state_billing (vx/engine/patches/,
which vx's plan applies in its own process, as vx's engines do), one layer per group: every block billed one page (vLLM alone bills the widest group's 16).
"""

import json
import math

import pytest

from vx.errors import UsageError
from vx.engine.plan import MIN_HIDDEN_BLOCK, gpu_attention_block, plan_engine
from vx.engine.plan_start import check_fits

QWEN36_27B = dict(  # Qwen3.6-27B (text config of the VL checkpoint)
    hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    intermediate_size=17408, linear_num_value_heads=48, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, weights_gb=54.0)
QWEN35_4B = dict(  # a Qwen3.5 4B-class target
    hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    intermediate_size=9216, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, weights_gb=9.3)
QWEN36_35B_A3B = dict(  # Qwen3.6-35B-A3B (MoE: 256 experts, 8 routed + 1 shared)
    hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, weights_gb=70.0, moe=True)
GPUS = {"H200": 141e9, "H100": 80e9, "RTX PRO 6000": 96e9}
STEP, SEQS, MEAN = 8192, 128, 335  # vx's GPU step and the dataset's mean sample


def write_config(tmp_path, spec: dict):
    text = {k: v for k, v in spec.items() if k not in ("weights_gb", "moe")}
    text.update(vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, mamba_ssm_dtype="float32",
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (spec["num_hidden_layers"] // 4),
                attn_output_gate=True, model_type="qwen3_5_moe_text" if spec.get("moe") else "qwen3_5_text",
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25})
    arch = "Qwen3_5MoeForCausalLM" if spec.get("moe") else "Qwen3_5ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "torch_dtype": "bfloat16", **text}))
    return tmp_path


def engine_config(model_dir, tp: int, max_model_len: int, layers: int = 5):
    from vllm.engine.arg_utils import EngineArgs

    from vx.engine.vllm_engine import engine_kwargs

    kw = engine_kwargs(model_dir, list(range(1, 1 + 15 * layers, 15)), on_cpu=False, max_model_len=max_model_len,
                       tensor_parallel_size=tp)
    kw.update(tokenizer=None, distributed_executor_backend="mp")
    return EngineArgs(**kw).create_engine_config()


def expected(spec: dict, tp: int, layers: int = 5) -> dict:
    """vLLM's rules over the config values, by hand."""
    kv = spec["num_key_value_heads"] // tp if spec["num_key_value_heads"] >= tp else 1
    attn_token = 2 * kv * spec["head_dim"] * 2  # K and V, bf16, per layer
    k, v = spec["linear_num_key_heads"] // tp, spec["linear_num_value_heads"] // tp
    kd, vd = spec["linear_key_head_dim"], spec["linear_value_head_dim"]
    conv = (2 * k * kd + v * vd) * (spec["linear_conv_kernel_dim"] - 1 + 1) * 2  # + 1 token: the spec method
    gdn_page = v * kd * vd * 4 + conv
    attention_block = 16 * math.ceil(gdn_page / (16 * attn_token))
    page = attention_block * attn_token
    per_token = layers * spec["hidden_size"] * 2
    cap = page // per_token
    hidden_block = max(d for d in range(1, min(attention_block, cap) + 1) if attention_block % d == 0)
    n = spec["num_hidden_layers"]
    return {"attention_block": attention_block, "hidden_block": hidden_block, "page": page,
            "bytes_per_block": page,  # one layer per group (the patch): a block is one page
            "attention_groups": n // 4, "gdn_groups": 3 * n // 4}  # 3 GDN layers to 1 attention layer


@pytest.mark.parametrize("name,spec", [("27B", QWEN36_27B), ("4B", QWEN35_4B), ("35B-A3B", QWEN36_35B_A3B)])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_gives_the_hidden_state_group_a_block_of_16_or_more(tmp_path, name, spec, tp):
    """For the longest sample of the real dataset (3,301 tokens incl. the sampled one) and a few
    arbitrary lengths: vLLM's own grouping, after vx's rounding, gives the block worked out by hand,
    never below 16; unrounded, most lengths would get 1."""
    model = write_config(tmp_path, spec)
    want = expected(spec, tp)
    for length in (3301, 337, 1999):
        config = engine_config(model, tp, length)
        attention = gpu_attention_block(config)
        assert attention == want["attention_block"], (name, tp)
        plan = plan_engine(config, 5, spec["hidden_size"], attention_block=attention)
        assert plan.hidden_block == want["hidden_block"] >= MIN_HIDDEN_BLOCK, (name, tp, length)
        assert plan.max_model_len >= length and plan.max_model_len % plan.hidden_block == 0
        assert plan.max_model_len - length < plan.hidden_block  # the least rounding that keeps the block
        assert plan.bytes_per_block == want["bytes_per_block"]
        unrounded = plan_engine(engine_config(model, tp, length), 5, spec["hidden_size"], attention_block=attention,
                                round_up=False)
        assert unrounded.hidden_block == math.gcd(want["attention_block"], length) or length % 16 == 0


def test_27b_on_one_gpu_matches_the_figures_worked_out_from_vllms_code(tmp_path):
    """Qwen3.6-27B, TP 1, layers [1,16,31,46,61]: attention block 800 tokens (a 3.3 MB GDN page in
    4,096-byte tokens), hidden-state block 50 (largest divisor of 800 within 64 tokens of
    51,200 B), one 3.3 MB page billed per block: 64 KiB per captured token, 1.28x its own size
    (vLLM alone: 16 pages, ~1 MiB, 20.5x)."""
    config = engine_config(write_config(tmp_path, QWEN36_27B), 1, 3301)
    plan = plan_engine(config, 5, 5120, attention_block=gpu_attention_block(config))
    assert (plan.attention_block, plan.hidden_block) == (800, 50)
    assert plan.bytes_per_block == 800 * 4096 and plan.widest_group == 1
    assert plan.billed_bytes_per_token == 65_536 and "not active" not in plan.line()
    assert plan.max_model_len == 3350


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name,spec", [("27B", QWEN36_27B), ("4B", QWEN35_4B), ("35B-A3B", QWEN36_35B_A3B)])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_fits_and_says_how_many_requests_stay_in_flight(tmp_path, gpu, name, spec, tp):
    """At 0.9 of the GPU less the weights (and 4 GB for activations), the blocks hold one request
    of max_model_len, and the plan says how many average requests stay in flight. Whether they
    cover two full 8,192-token steps (async scheduling frees a step's finished requests after the
    next one is scheduled): everywhere but 27B on one 80 GB H100, where 14 GB beside the weights
    hold ~35 average requests (a request's 16 attention pages, 96 GDN ones and 7 hidden-state ones)."""
    config = engine_config(write_config(tmp_path, spec), tp, 3301)
    available = int(GPUS[gpu] * 0.9 - spec["weights_gb"] * 1e9 / tp - 4e9)
    plan = plan_engine(config, 5, spec["hidden_size"], available_bytes=available,
                       attention_block=gpu_attention_block(config))
    if (name, gpu, tp) == ("35B-A3B", "H100", 1):  # 70 GB of bf16 weights in 72 GB: refused in one line
        with pytest.raises(UsageError, match="cannot start"):
            check_fits(plan, tp)
        return
    check_fits(plan, tp)  # one request of max_model_len fits
    assert plan.num_blocks == available // expected(spec, tp)["bytes_per_block"]
    # a request's blocks: attention and hidden states by length, 2 per GDN group (its state + the
    # extract_hidden_states method's spare), vLLM's null block aside
    want = expected(spec, tp)
    per_request = (want["attention_groups"] * -(-MEAN // want["attention_block"]) + want["gdn_groups"] * 2
                   + -(-MEAN // want["hidden_block"]))
    in_flight = plan.requests_in_flight(MEAN)
    assert plan.blocks_for(MEAN) == per_request and in_flight == (plan.num_blocks - 1) // per_request
    covers = in_flight * MEAN >= 2 * STEP
    assert covers == ((name, tp, gpu) != ("27B", 1, "H100")), plan.line(MEAN)
    assert f"or {in_flight:,} of {MEAN} tokens" in plan.line(MEAN)


def test_a_max_model_len_that_cannot_fit_stops_before_any_weight_loads(tmp_path):
    """27B on one H100: 14 GB beside the weights hold ~4,300 pages of 3.3 MB; a request of the
    model's 262,144 tokens needs 16 x 328 attention pages, 96 GDN ones and 5,243 hidden-state ones."""
    config = engine_config(write_config(tmp_path, QWEN36_27B), 1, 262144)
    plan = plan_engine(config, 5, 5120, available_bytes=int(80e9 * 0.9 - 54e9 - 4e9),
                       attention_block=gpu_attention_block(config))
    with pytest.raises(UsageError, match="cannot start.*--max-model-len.*--tensor-parallel-size"):
        check_fits(plan, 1)


@pytest.mark.parametrize("gpu,name,spec,tp,fits", [
    ("H200", "27B", QWEN36_27B, 1, True), ("H100", "27B", QWEN36_27B, 1, False), ("H100", "27B", QWEN36_27B, 2, True),
    ("H100", "4B", QWEN35_4B, 1, True), ("RTX PRO 6000", "35B-A3B", QWEN36_35B_A3B, 2, True)])
def test_the_one_pass_mode_splits_one_gpus_memory_between_its_engines_or_refuses_in_one_line(
        tmp_path, gpu, name, spec, tp, fits):
    """--regenerate on a GPU: one --gpu-memory-utilization (0.9) for the whole device, shared by the
    generation and the capture, each with its copy of the weights and 4 GB for activations: the two
    shares sum to it, each holds at least one request of max_model_len beside its weights, and the
    capture keeps two full 8,192-token steps in flight where half the room allows. Where two copies of the weights leave no such room: one line naming the remedies."""
    from vx.engine.plan_start import GPU_RESERVE, split_gpu

    config = engine_config(write_config(tmp_path, spec), tp, 3301 + 16)
    plan = plan_engine(config, 5, spec["hidden_size"], attention_block=gpu_attention_block(config))
    total, weights = GPUS[gpu], spec["weights_gb"] * 1e9 / tp
    one = (plan.blocks_for(plan.max_model_len) + 1) * expected(spec, tp)["bytes_per_block"]
    if not fits:
        with pytest.raises(UsageError, match="two engines.*--tensor-parallel-size.*vx regenerate") as e:
            split_gpu(total, 0.9, weights, plan, STEP, MEAN, tp)
        assert "\n" not in str(e.value)
        return
    s = split_gpu(total, 0.9, weights, plan, STEP, MEAN, tp)
    assert 0.899 <= s.regeneration + s.capture <= 0.9
    for share in (s.regeneration, s.capture):  # what vLLM gives each engine's KV cache, by its own rule
        assert share * total - weights - GPU_RESERVE >= one * 0.999
    capture_kv = s.capture * total - weights - GPU_RESERVE
    room = 0.9 * total - 2 * (weights + GPU_RESERVE)
    step_blocks = 2 * math.ceil(STEP / MEAN) * plan.blocks_for(MEAN)
    assert capture_kv >= min(step_blocks * plan.bytes_per_block, room / 2) * 0.999
    assert f"regeneration {s.regeneration}, capture {s.capture}" in s.line


def test_a_plan_whose_groups_are_wider_than_one_layer_names_the_inactive_billing_change():
    """vLLM without vx's change hidden_state_billing (vx/engine/patches/) groups a 27B target's layers
    16 to a group and bills each hidden-state block 16 pages: the plan line (the run's summary, `vx
    selftest --model`) says so and names the change that is not active; a dense model's single
    group is not flagged."""
    from vx.engine.plan import EnginePlan

    unpatched = EnginePlan(max_model_len=3350, attention_block=800, hidden_block=50, hidden_bytes_per_token=51_200,
                           bytes_per_block=16 * 800 * 4096, hybrid=True,
                           groups=[("attention", 16, 800), ("gdn", 16, 3350), ("gdn", 16, 3350), ("gdn", 16, 3350),
                                   ("hidden", 1, 50)])
    assert "widest group's 16 pages" in unpatched.line()
    assert "vx's change hidden_state_billing is not active" in unpatched.line()
    dense = EnginePlan(max_model_len=4096, attention_block=16, hidden_block=16, hidden_bytes_per_token=51_200,
                       bytes_per_block=64 * 16 * 4096, groups=[("attention", 64, 16)])
    assert "not active" not in dense.line()
