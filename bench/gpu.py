"""One-shot GPU benchmark on a random-weight model of the real Qwen3.6-27B shape (no download).

    bash bench/gpu.sh            # writes $OUT/gpu-bench.json (or bench/results/ without $OUT)

64 layers = 16 x (3 GDN + 1 full attention), hidden 5120, intermediate 17408, vocab 248320;
attention 24 q / 4 kv heads of 256; GDN 16 qk / 48 v heads of 128, conv 4; bf16, built on the GPU.
Compares hf-naive (batch 1, output_hidden_states=True, full forward with logits) against vx's
hf-hooks at batch 1, 32, 128, 256 on a seeded length mix like the real chat data (lognormal,
mean ~335, capped at 3,300 tokens). MFU = useful FLOPs (layers up to the last target, real tokens)
/ time / a bf16 matmul peak measured in the same run. Budget: under 8 minutes.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEADLINE_S = float(os.environ.get("VX_BENCH_DEADLINE_S", 420))


def qwen36_27b_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
        max_position_embeddings=8192, tie_word_embeddings=False, dtype="bfloat16")


def length_mix(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    mu, sigma = math.log(335) - 0.5 * 0.9 ** 2, 0.9  # lognormal with mean ~335
    return [max(8, min(3300, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def main():
    import torch
    from transformers import Qwen3_5ForCausalLM

    from common import matmul_peak_flops, useful_flops
    from vx.data.samples import Sample
    from vx.engine.hf_extractor import HFExtractor, length_sorted_batches
    from vx.data.layers import default_layer_ids

    t_start = time.perf_counter()
    smoke = os.environ.get("VX_BENCH_SMOKE") == "1"  # tiny shape on CPU: checks this script's logic
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a GPU (VX_BENCH_SMOKE=1 runs a tiny CPU smoke test)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu-smoke", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__}
    peak = matmul_peak_flops(n=512 if smoke else 8192, seconds=1.0 if smoke else 5.0)
    result["matmul_peak_tflops"] = peak / 1e12
    print(f"peak {peak / 1e12:.0f} TFLOP/s", flush=True)

    config = qwen36_27b_config()
    if smoke:
        config = type(config)(**{**config.to_dict(), "hidden_size": 128, "intermediate_size": 256,
                                 "num_hidden_layers": 8, "layer_types": config.layer_types[:8], "vocab_size": 1024,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                                 "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                                 "linear_key_head_dim": 64, "linear_value_head_dim": 64})
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    sync()
    result["build_s"] = time.perf_counter() - t
    result["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    layer_ids = default_layer_ids(config.num_hidden_layers)
    result["layer_ids"] = layer_ids
    print(f"model built in {result['build_s']:.0f}s, {result['params_b']:.1f}B params", flush=True)

    def save():
        (out_dir / "gpu-bench.json").write_text(json.dumps(result, indent=2) + "\n")

    def run(mode: str, samples, batch: int):
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        computed = 0
        with torch.inference_mode():
            if mode == "hf-naive":
                for s in samples:
                    hs = model(torch.tensor([s.input_ids], device=dev), output_hidden_states=True).hidden_states
                    torch.stack([hs[k + 1][0] for k in layer_ids], dim=1).to("cpu")
                    computed += len(s)
            else:
                ex = HFExtractor(model, layer_ids)
                for b in length_sorted_batches(samples, batch, 262144, 8192):
                    computed += len(b) * len(b[0])
                    for x in ex.extract(b):  # what vx's writer does with each sample
                        x.to("cpu")
                ex.remove()
        sync()
        wall = time.perf_counter() - t
        lengths = [len(s) for s in samples]
        flops = useful_flops(config, max(layer_ids), lengths)
        return {"mode": mode, "batch": batch, "samples": len(samples), "tokens": sum(lengths),
                "wall_s": wall, "samples_per_s": len(samples) / wall, "tokens_per_s": sum(lengths) / wall,
                "padding_efficiency": sum(lengths) / computed, "mfu": flops / wall / peak,
                "cuda_max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None}

    rng = random.Random(1)
    vocab = config.vocab_size - 1
    pool = [Sample(str(i), i, [rng.randrange(vocab) for _ in range(n)], [1] * n)
            for i, n in enumerate(length_mix(64 if smoke else 2048))]
    result["lengths"] = {"mean": sum(map(len, pool)) / len(pool), "max": max(map(len, pool))}
    run("hf-hooks", pool[:8], 8)  # warm-up: kernels, allocator
    result["runs"] = []
    plan = [("hf-naive", 1, 48), ("hf-hooks", 1, 48), ("hf-hooks", 32, 512), ("hf-hooks", 128, 1024),
            ("hf-hooks", 256, 2048)]
    if smoke:
        plan = [(m, b, min(n, 16)) for m, b, n in plan]
    for mode, batch, n in plan:
        if time.perf_counter() - t_start > DEADLINE_S:
            result.setdefault("skipped", []).append([mode, batch])
            continue
        try:
            r = run(mode, pool[:n], batch)
        except torch.OutOfMemoryError as e:
            r = {"mode": mode, "batch": batch, "error": f"OOM: {str(e)[:200]}"}
            torch.cuda.empty_cache()
        result["runs"].append(r)
        print(json.dumps(r), flush=True)
        save()
    naive = next((r for r in result["runs"] if r["mode"] == "hf-naive" and "error" not in r), None)
    best = max((r for r in result["runs"] if r["mode"] == "hf-hooks" and "error" not in r),
               key=lambda r: r["samples_per_s"], default=None)
    if naive and best:
        result["best_hooks"] = {"batch": best["batch"], "mfu": best["mfu"],
                                "x_hf_naive": best["samples_per_s"] / naive["samples_per_s"]}
    result["total_s"] = time.perf_counter() - t_start
    save()
    print(json.dumps(result.get("best_hooks")), flush=True)


if __name__ == "__main__":
    main()
