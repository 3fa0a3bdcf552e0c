"""`vx regenerate` against a plain `LLM.generate` of the same prompts with the same sampling, in
one run: generated tokens/s, engine start excluded for both (vx: from its first request to its
last committed conversation, output written and fsynced; plain: the `generate` call).

Prompts: the first-turn ShareGPT prompts in ../shared/data/chat/sharegpt_prompts.jsonl (exits
saying so when absent), rendered with the embedded model's chat template; greedy, --max-tokens.

    python bench/regenerate.py [--prompts 200] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ROOT.parent / "shared" / "data" / "chat" / "sharegpt_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if not PROMPTS.exists():
        raise SystemExit(f"bench/regenerate.py needs {PROMPTS} (../shared beside the checkout); it is absent here")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vx.chat import ChatTemplate, conversation
    from vx.model import load_tokenizer
    from vx.regenerate import RegenConfig, run_regenerate
    from vx.tiny import default_model_dir

    model = default_model_dir()
    rows = [json.loads(x) for x in PROMPTS.read_bytes().split(b"\n") if x.strip()][: args.prompts]
    with tempfile.TemporaryDirectory(prefix="vx-bench-regen-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        s = run_regenerate(RegenConfig(data=str(data), output=Path(tmp) / "regen.jsonl", model=str(model),
                                       turns="last", max_tokens=args.max_tokens), progress=False)
    vx_tps = s["generated_tokens"] / s["generate_s"]

    from vllm import LLM, SamplingParams

    from vx.vllm_backend import stop_engine_core

    tok = load_tokenizer(model)
    chat = ChatTemplate(tok)
    prompts = []
    for r in rows:
        msgs = [m for m in conversation(r.get("messages") or r["conversations"]) if m["role"] != "assistant"]
        prompts.append({"prompt_token_ids": tok(chat.render(msgs, gen=True), add_special_tokens=False)["input_ids"]})
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
              enable_prefix_caching=True, seed=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    plain_s = time.perf_counter() - t
    plain_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stop_engine_core(llm.llm_engine)
    result = {"prompts": len(rows), "max_tokens": args.max_tokens,
              "vx": {"generated_tokens": s["generated_tokens"], "s": s["generate_s"], "tokens_per_s": round(vx_tps, 1)},
              "plain": {"generated_tokens": plain_tokens, "s": round(plain_s, 3),
                        "tokens_per_s": round(plain_tokens / plain_s, 1)},
              "ratio": round(vx_tps / (plain_tokens / plain_s), 3)}
    print(json.dumps(result, indent=2))
    out = ROOT / "bench" / "results" / "regenerate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
