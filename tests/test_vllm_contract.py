"""vx's vLLM engine runs on the contract both model runners implement, and says so before loading.

- vLLM's own runner choice (`VllmConfig.use_v2_model_runner`) for the engine vx builds, with
  Triton reported present (as on every CUDA install): Model Runner V2, nothing unsupported.
- A vLLM missing part of the contract, a version outside the tested range, or a model without
  the aux-output interface stops with one line before any weight loads (no engine process).
- The GPU defaults fit a Qwen3.6-27B-class target on one 141 GB H200 (arithmetic on paper).
"""

import subprocess
import sys
import time

import pytest

from vx.engine.defaults import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, plan_memory
from vx.errors import UsageError
from vx.engine.vllm_engine import engine_kwargs
from vx.engine.contract import check_vllm_contract, check_vllm_version


def engine_config(model, monkeypatch, **options):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return EngineArgs(**engine_kwargs(model, [1, 2, 3, 4, 5], on_cpu=False, **options)).create_engine_config()


def test_with_triton_present_vllm_picks_model_runner_v2_for_vx_engine(tiny_model, monkeypatch):
    import vllm.config.vllm as vllm_config_module

    config = engine_config(tiny_model, monkeypatch)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # what a CUDA install reports
    assert config.use_v2_model_runner is True
    assert config._get_v2_model_runner_unsupported_features() == []
    # the engine is compiled by default (no forced eager) and runs vLLM's extraction method
    assert config.model_config.enforce_eager is False
    assert config.speculative_config.method == "extract_hidden_states"
    assert config.kv_transfer_config.kv_connector_module_path == "vx.engine.connector"
    aux = config.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids
    assert list(aux) == [2, 3, 4, 5, 6]  # layer id k is the stream entering layer k + 1


def test_the_v2_runner_builds_vllm_extraction_speculator_for_this_config(tiny_model, monkeypatch):
    """Runner V2's speculator factory maps the method vx asks for to its own extractor class."""
    from vllm.v1.worker.gpu.spec_decode import extract_hidden_states as v2

    source = open(sys.modules["vllm.v1.worker.gpu.spec_decode"].__file__).read()
    config = engine_config(tiny_model, monkeypatch)
    assert f'method == "{config.speculative_config.method}"' in source
    assert hasattr(v2, "ExtractHiddenStatesSpeculator")


def test_versions_outside_the_tested_range_are_refused():
    for ok in ("0.32.0", "0.33.0", "0.33.2"):
        check_vllm_version(ok)
    for bad in ("0.31.9", "0.34.0", "1.0.0"):
        with pytest.raises(UsageError, match="not supported"):
            check_vllm_version(bad)


def test_a_model_without_the_aux_output_interface_is_refused_before_loading(tmp_path):
    """A plain GPT-2 (vLLM implements no EAGLE-3 aux outputs for it) is refused from its config alone."""
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=300).save_pretrained(tmp_path)  # no weights at all
    with pytest.raises(UsageError, match="SupportsEagle3"):
        check_vllm_contract({"model": str(tmp_path), "tokenizer": str(tmp_path), "dtype": "float32"})


def test_a_vllm_missing_the_runner_v2_extractor_stops_before_any_weight_loads(tiny_model):
    """Blocks the V2 speculator module (as in a vLLM without it) and starts an extractor: one line,
    in seconds, no engine process started."""
    code = (
        "import sys; sys.modules['vllm.v1.worker.gpu.spec_decode.extract_hidden_states'] = None\n"
        "from vx.engine.vllm_extractor import VllmExtractor\n"
        "from vx.errors import UsageError\n"
        "try:\n"
        f"    VllmExtractor({str(tiny_model)!r}, [1, 2])\n"
        "except UsageError as e:\n"
        "    print('REFUSED', e)\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in r.stdout, r.stderr[-2000:]
    assert "ExtractHiddenStatesSpeculator" in r.stdout
    assert "EngineCore" not in r.stderr and "Loading weights" not in r.stderr
    assert time.monotonic() - t0 < 120


def test_gpu_defaults_fit_a_27b_hybrid_target_on_one_h200():
    """Qwen3.6-27B-class: 64 layers (48 GDN, 16 full attention: 4 KV heads x 256), hidden 5120,
    GDN 16 key / 48 value heads of 128, fp32 recurrent state; 5 captured layers; 54 GB of bf16
    weights, 6 GB of activations for an 8,192-token step; 141 GB at 0.9."""
    plan = plan_memory(gpu_bytes=141e9, utilization=0.9, weight_bytes=54e9, activation_bytes=6e9,
                       full_attention_layers=16, kv_heads=4, head_dim=256, gdn_layers=48, gdn_k_heads=16,
                       gdn_v_heads=48, gdn_k_dim=128, gdn_v_dim=128, conv_kernel=4, capture_layers=5,
                       hidden=5120, max_num_seqs=MAX_NUM_SEQS, ssm_state_bytes=4)
    assert plan.states_bytes_per_token == 51_200 and plan.kv_bytes_per_token == 65_536
    assert round(plan.states_overhead, 2) == 0.78  # the "+78% over its attention KV"
    # a full step, plus every in-flight request at twice the dataset's mean length (335)
    assert MAX_NUM_BATCHED_TOKENS >= 8192
    assert plan.max_tokens >= MAX_NUM_BATCHED_TOKENS + MAX_NUM_SEQS * 2 * 335
    print(plan, plan.max_tokens)


def test_a_cpu_engine_gets_a_kv_cache_sized_to_its_job_not_30_percent_of_host_memory(tiny_model, monkeypatch):
    """vLLM's CPU default zero-fills 0.3 of host memory as the engine starts (5.9 GiB, ~9 s on 2
    cores). vx asks for 1 GiB per 2,048 tokens of max_model_len instead, and steps aside where the
    user chose: VLLM_CPU_KVCACHE_SPACE, --gpu-memory-utilization, or no max_model_len known."""
    from vllm.engine.arg_utils import EngineArgs

    GiB = 1 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for max_model_len, gib in ((759, 1), (2048, 1), (2049, 2), (5000, 3)):
        kwargs = engine_kwargs(tiny_model, [1, 2], on_cpu=True, max_model_len=max_model_len)
        assert kwargs["kv_cache_memory_bytes"] == gib * GiB
    # vLLM takes it as its own setting (the CPU worker then skips its auto sizing)
    kwargs = engine_kwargs(tiny_model, [1, 2], on_cpu=True, max_model_len=759)
    assert EngineArgs(**kwargs).create_engine_config().cache_config.kv_cache_memory_bytes == GiB
    assert "kv_cache_memory_bytes" not in engine_kwargs(tiny_model, [1, 2], on_cpu=True)
    assert "kv_cache_memory_bytes" not in engine_kwargs(tiny_model, [1, 2], on_cpu=True, max_model_len=759,
                                                        gpu_memory_utilization=0.2)
    assert "kv_cache_memory_bytes" not in engine_kwargs(tiny_model, [1, 2], on_cpu=False, max_model_len=759)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert "kv_cache_memory_bytes" not in engine_kwargs(tiny_model, [1, 2], on_cpu=True, max_model_len=759)
