"""Peak memory of HF `output_hidden_states=True` against vx's target-layer hooks at large batch.

    python bench/memory.py [--layers 32] [--batch 128] [--seq 512]

Each method runs in its own subprocess on the same random 32-layer hybrid-GDN model (bf16), one
forward of batch x seq tokens with the real 248k vocabulary; reported: peak RSS (CUDA max
allocated on GPU) above the RSS after loading the model. The user's original keeps all layers + 1
alive and computes full-vocabulary logits for every position; hooks keep 5 layers, no LM head.
Random token ids are drawn from the tiny tokenizer's range (ids do not change memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(method: str, model_dir: str, batch: int, seq: int) -> dict:
    import torch

    from vx.data.samples import Sample
    from vx.engine.hf_extractor import HFExtractor, load_hf_model
    from vx.data.layers import default_layer_ids

    model = load_hf_model(model_dir, "bfloat16")
    cuda = torch.cuda.is_available()
    layer_ids = default_layer_ids(model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (batch, seq), generator=g)
    base = _rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    t = time.perf_counter()
    with torch.inference_mode():
        if method == "output_hidden_states":
            hs = model(ids.to(model.device), output_hidden_states=True).hidden_states
            kept = torch.stack([hs[k + 1] for k in layer_ids], dim=2)  # what the user then keeps
        else:
            ex = HFExtractor(model, layer_ids)
            kept = ex.extract([Sample(str(i), i, row.tolist(), []) for i, row in enumerate(ids)])
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"method": method, "wall_s": wall, "peak_rss_above_model_gb": (peak - base) / 1e9,
           "kept_gb": sum(k.numel() * k.element_size() for k in (kept if isinstance(kept, list) else [kept])) / 1e9}
    if cuda:
        out["cuda_peak_above_model_gb"] = (torch.cuda.max_memory_allocated() - base_cuda) / 1e9
    return out


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=248320, help="the real Qwen3.5/3.6 embedding rows")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.batch, args.seq)))
        return None
    from vx.data.tiny import build_tiny_model
    from vx.home import cache_dir

    model_dir = cache_dir() / f"bench-mem-L{args.layers}-H{args.hidden}-V{args.vocab}"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab)
    results = {}
    for method in ("output_hidden_states", "hooks"):
        r = subprocess.run([sys.executable, __file__, "--child", method, str(model_dir), "--batch", str(args.batch),
                            "--seq", str(args.seq)], capture_output=True, text=True, check=True)
        results[method] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(results[method]), file=sys.stderr)
    key = "cuda_peak_above_model_gb" if "cuda_peak_above_model_gb" in results["hooks"] else "peak_rss_above_model_gb"
    ratio = results["hooks"][key] / results["output_hidden_states"][key]
    summary = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "metric": key,
               "output_hidden_states_gb": round(results["output_hidden_states"][key], 3),
               "hooks_gb": round(results["hooks"][key], 3), "hooks_over_ohs": round(ratio, 3), "runs": results}
    print(json.dumps(summary))
    from common import write_result

    print(f"wrote {write_result('memory', summary)}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
