"""One-shot GPU benchmark of the vLLM path on a Qwen3.6-27B-shaped model with random weights.

    python bench/gpu_vllm.py      # run by bench/gpu.sh when vLLM is installed; JSON to $OUT

vLLM builds the model from its config with `load_format="dummy"` (random weights, nothing to
download or load). One engine at a time (three 27B engines do not fit one GPU), compiled with
CUDA graphs (vLLM's default), each warmed up, on the same seeded length mix as bench/gpu.py:
  vx-vllm       vx's engine: extract_hidden_states + vx's connector, shards to local disk
  vllm-bare     the same engine settings, prefill only, no capture
  vllm-builtin  vLLM's extract_hidden_states + its stock ExampleHiddenStatesConnector
MFU = useful FLOPs (layers up to the last target, real tokens) / time / the matmul peak
measured in the same run. VX_BENCH_SMOKE=1 runs tiny shapes on CPU (checks this script's logic).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                         os.environ.get("PYTHONPATH")]))

DEADLINE_S = float(os.environ.get("VX_BENCH_DEADLINE_S", 540))


def model_dir(smoke: bool) -> Path:
    """A checkpoint directory with the 27B config and a small tokenizer, and no weights."""
    from gpu import qwen36_27b_config

    from vx.data.tiny import build_tokenizer, tiny_text_config

    path = Path(tempfile.mkdtemp(prefix="vx-27b-"))
    tok = build_tokenizer(path)
    config = tiny_text_config(tok) if smoke else qwen36_27b_config()
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(path)
    return path


def main():
    import torch

    from common import matmul_peak_flops, useful_flops
    from gpu import length_mix
    from throughput import run_vllm_bare, run_vllm_builtin, run_vx_vllm, vllm_engines

    from vx.data.samples import Sample
    from vx.data.layers import default_layer_ids

    t_start = time.perf_counter()
    smoke = os.environ.get("VX_BENCH_SMOKE") == "1"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_vllm.py needs a GPU (VX_BENCH_SMOKE=1 runs a tiny CPU smoke test)")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    import vllm

    mdir = model_dir(smoke)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(mdir)
    layer_ids = default_layer_ids(config.num_hidden_layers)
    peak = matmul_peak_flops(n=512 if smoke else 8192, seconds=1.0 if smoke else 5.0)
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu-smoke",
              "vllm": vllm.__version__, "matmul_peak_tflops": peak / 1e12, "layer_ids": layer_ids, "runs": []}
    import random

    rng = random.Random(1)
    samples = [Sample(str(i), i, [rng.randrange(config.vocab_size - 1) for _ in range(n)], [1] * n)
               for i, n in enumerate(length_mix(32 if smoke else 1500))]
    lengths = [len(s) for s in samples]
    flops = useful_flops(config, max(layer_ids), lengths)
    result["lengths"] = {"n": len(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)}
    tmp = Path(tempfile.mkdtemp(prefix="vx-gpu-vllm-"))
    overrides = {"load_format": "dummy"}
    try:
        for mode in ("vx-vllm", "vllm-bare", "vllm-builtin"):
            if time.perf_counter() - t_start > DEADLINE_S:
                result.setdefault("skipped", []).append(mode)
                continue
            t = time.perf_counter()
            engines = vllm_engines([mode], mdir, layer_ids, smoke, tmp / "builtin", samples[:8],
                                   util=0.08 if smoke else 0.9, overrides=overrides)
            start_s = time.perf_counter() - t
            out = tmp / mode
            out.mkdir()
            try:
                t = time.perf_counter()
                if mode == "vx-vllm":
                    run_vx_vllm(engines[mode], samples, config.hidden_size, out)
                elif mode == "vllm-bare":
                    run_vllm_bare(engines[mode], samples)
                else:
                    run_vllm_builtin(engines[mode], samples, out)
                wall = time.perf_counter() - t
            finally:
                from throughput import close_engines

                close_engines(engines)
                shutil.rmtree(out, ignore_errors=True)
            r = {"mode": mode, "engine_start_s": start_s, "wall_s": wall, "tokens_per_s": sum(lengths) / wall,
                 "samples_per_s": len(samples) / wall, "mfu": flops / wall / peak}
            result["runs"].append(r)
            print(json.dumps(r), flush=True)
            (out_dir / "gpu-vllm-bench.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(mdir, ignore_errors=True)
    by = {r["mode"]: r["samples_per_s"] for r in result["runs"]}
    if "vx-vllm" in by:
        result["ratios"] = {f"vx_over_{m}": by["vx-vllm"] / by[m] for m in ("vllm-bare", "vllm-builtin") if m in by}
    result["total_s"] = time.perf_counter() - t_start
    (out_dir / "gpu-vllm-bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result.get("ratios")), flush=True)


if __name__ == "__main__":
    main()
