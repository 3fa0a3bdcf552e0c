"""What vx's capture hook + in-worker shard writing cost against a bare vLLM prefill of the same
requests (same engine settings, prefill only), on the embedded tiny model and examples/chat.jsonl.

    python bench/hook_cost.py
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    from vllm import LLM, SamplingParams

    from vx.dataset import Sample, read_samples
    from vx.layers import default_layer_ids
    from vx.model import load_tokenizer, model_info
    from vx.tiny import default_model_dir
    from vx.vllm_backend import VllmExtractor, _cpu_env

    _cpu_env()
    model = default_model_dir()
    samples = [s for s in read_samples(ROOT / "examples/chat.jsonl", load_tokenizer(model)) if isinstance(s, Sample)]
    tokens = sum(len(s) for s in samples)
    layers = default_layer_ids(model_info(model).num_layers)
    results = {}
    for rep in range(2):
        ex = VllmExtractor(model, layers, gpu_memory_utilization=0.1)
        out = Path(tempfile.mkdtemp())
        t = time.perf_counter()
        ex.run(samples, out, {"model": "bench"}, 10**9, 0, model_info(model).hidden_size, "bf16")
        results.setdefault("vx", []).append(time.perf_counter() - t)
        ex.close()
        shutil.rmtree(out)
        llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                  gpu_memory_utilization=0.1)
        params = SamplingParams(max_tokens=1, detokenize=False)
        llm.generate([{"prompt_token_ids": s.input_ids} for s in samples[:4]], params, use_tqdm=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": s.input_ids} for s in samples], params, use_tqdm=False)
        results.setdefault("bare", []).append(time.perf_counter() - t)
        llm.llm_engine.engine_core.shutdown()
    vx_s, bare_s = min(results["vx"]), min(results["bare"])
    print(json.dumps({"samples": len(samples), "tokens": tokens, "vx_tokens_per_s": round(tokens / vx_s),
                      "bare_tokens_per_s": round(tokens / bare_s), "vx_over_bare": round(bare_s / vx_s, 3),
                      "runs_s": results}))


if __name__ == "__main__":
    main()
