"""What vx's capture costs in KV capacity: the same engine with and without it, same memory budget.

    python bench/kv_capacity.py [--util 0.1] [--max-model-len 4096]

vx's engine adds vLLM's extract_hidden_states method: a cache-only KV group of L x H x 2 bytes per
token, and one extra GDN state block per running request. Each engine is started in its own
process on the embedded tiny model (8 layers: 6 GDN, 2 attention, hidden 256, 5 captured layers);
vLLM's own report of its KV capacity (tokens, and maximum concurrency at max_model_len) is read
from its log. Writes bench/results/kv_capacity-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, json
from vx.data.tiny import default_model_dir
from vx.device import engine_env
from vx.engine.vllm_engine import engine_kwargs
import torch
engine_env()
kw = engine_kwargs(default_model_dir(), [1, 2, 3, 4, 5], on_cpu=not torch.cuda.is_available(),
                   gpu_memory_utilization={util}, max_model_len={max_len}, enforce_eager=True)
if {bare}:
    for k in ("speculative_config", "kv_transfer_config", "worker_extension_cls"):
        kw.pop(k)
from vllm import LLM
llm = LLM(**kw)
llm.llm_engine.engine_core.shutdown()
"""

PATTERN = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def measure(bare: bool, util: float, max_len: int) -> dict:
    code = "if __name__ == '__main__':\n" + "\n".join("    " + line for line in
                                                      CHILD.format(util=util, max_len=max_len, bare=bare).splitlines())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    m = PATTERN.search(r.stderr + r.stdout)
    if m is None:
        raise SystemExit(f"no KV capacity line in the engine's log:\n{r.stderr[-3000:]}")
    return {"kv_tokens": int(m.group(1).replace(",", "")), "max_concurrency": float(m.group(3))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--util", type=float, default=0.1, help="fraction of host (GPU) memory for the engine")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    bare = measure(True, args.util, args.max_model_len)
    vx = measure(False, args.util, args.max_model_len)
    result = {"util": args.util, "max_model_len": args.max_model_len, "bare": bare, "vx": vx,
              "kv_tokens_ratio": vx["kv_tokens"] / bare["kv_tokens"],
              "concurrency_ratio": vx["max_concurrency"] / bare["max_concurrency"],
              "model": "embedded tiny (8 layers: 6 GDN + 2 attention, hidden 256, 2 KV heads x 64), 5 captured"}
    print(json.dumps(result, indent=2))
    import torch

    from common import write_result

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print(f"wrote {write_result('kv_capacity', result, args.out, device)}", file=sys.stderr)


if __name__ == "__main__":
    main()
