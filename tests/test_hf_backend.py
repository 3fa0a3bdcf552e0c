"""The HF backend: hooks on target layers equal a per-sample HF forward, and nothing extra runs."""

import random

import pytest
import torch

from vx.data.samples import Sample
from vx.engine.hf_extractor import HFExtractor, length_sorted_batches, load_hf_model

TOL = 1e-5  # fp32, batched + right-padded vs batch 1 unpadded


@pytest.fixture(scope="module")
def mixed_samples(fp32_model):
    rng = random.Random(0)
    vocab = fp32_model.config.vocab_size
    lengths = [1, 2, 3, 63, 64, 65, 400] + [rng.randint(1, 400) for _ in range(57)]
    return [Sample(f"s{i}", i + 1, [rng.randrange(vocab) for _ in range(n)], [1] * n)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference(fp32_model, mixed_samples):
    """Per-sample HF forward at batch 1 with output_hidden_states=True."""
    out = {}
    with torch.inference_mode():
        for s in mixed_samples:
            hs = fp32_model(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
            out[s.id] = [h[0] for h in hs]
    return out


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_hook_states_equal_the_per_sample_reference(fp32_model, mixed_samples, reference, batch_size):
    n_layers = fp32_model.config.num_hidden_layers
    layer_ids = list(range(n_layers))  # first and last decoder layer included
    ex = HFExtractor(fp32_model, layer_ids)
    try:
        seen = 0
        for batch in length_sorted_batches(mixed_samples, batch_size, 10**9, sort_window=10**6,
                                           min_padding_efficiency=0.0):
            assert len(batch) <= batch_size
            for s, got in zip(batch, ex.extract(batch)):
                ref = reference[s.id]
                assert got.shape == (len(s), n_layers, fp32_model.config.hidden_size)
                for j, k in enumerate(layer_ids[:-1]):
                    torch.testing.assert_close(got[:, j], ref[k + 1], atol=TOL, rtol=0)
                # HF's last hidden_states entry is post-norm; ours is the pre-norm residual stream.
                last = got[:, -1]
                torch.testing.assert_close(fp32_model.model.norm(last), ref[n_layers], atol=TOL, rtol=0)
                assert not torch.allclose(last, ref[n_layers], atol=1e-3)
                seen += 1
        assert seen == len(mixed_samples)
    finally:
        ex.remove()


def test_layers_after_the_last_target_and_the_lm_head_never_run(fp32_model, mixed_samples):
    calls = {}

    def counter(name):
        def hook(*_):
            calls[name] = calls.get(name, 0) + 1
        return hook

    layers = fp32_model.model.layers
    handles = [layers[k].register_forward_hook(counter(f"layer{k}")) for k in range(len(layers))]
    handles.append(fp32_model.model.norm.register_forward_hook(counter("norm")))
    handles.append(fp32_model.lm_head.register_forward_hook(counter("lm_head")))
    ex = HFExtractor(fp32_model, [1, 3])
    try:
        ex.extract(mixed_samples[:5])
    finally:
        ex.remove()
        for h in handles:
            h.remove()
    assert calls == {"layer0": 1, "layer1": 1, "layer2": 1, "layer3": 1}


def test_vision_language_checkpoint_extracts_text_only_and_equals_its_text_twin(tiny_model, tiny_vl_model,
                                                                                 mixed_samples):
    text = load_hf_model(tiny_model, "auto", "cpu")
    vl = load_hf_model(tiny_vl_model, "auto", "cpu")
    assert not any("visual" in name for name, _ in vl.named_modules()), "vision tower was loaded"
    batch = mixed_samples[:6]
    a = HFExtractor(text, [0, 3, 7]).extract(batch)
    b = HFExtractor(vl, [0, 3, 7]).extract(batch)
    # dtype auto: the checkpoint's bf16, or float32 on a CPU whose flags name no bf16 instructions
    flags = " ".join(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
    native = any(f in flags.split() for f in ("avx512_bf16", "amx_bf16", "bf16"))
    for x, y in zip(a, b):
        assert x.dtype == (torch.bfloat16 if native else torch.float32)
        assert torch.equal(x, y)


def test_batches_are_length_sorted_and_bounded_by_tokens_and_padding():
    rng = random.Random(1)
    samples = [Sample(str(i), i, [0] * n, [1] * n) for i, n in enumerate(rng.randint(1, 3000) for _ in range(500))]
    batches = list(length_sorted_batches(samples, batch_size=64, max_batch_tokens=20000, sort_window=200))
    assert sorted(s.id for b in batches for s in b) == sorted(s.id for s in samples)
    for b in batches:
        assert len(b) <= 64 and (len(b) == 1 or len(b[0]) * len(b) <= 20000)
        assert [len(s) for s in b] == sorted((len(s) for s in b), reverse=True)
        assert sum(len(s) for s in b) >= 0.95 * len(b[0]) * len(b)
