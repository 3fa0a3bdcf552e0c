"""`vx regenerate` against a plain `LLM.generate` of the same prompts with the same sampling, in
one run: generated tokens/s, engine start excluded for both (vx: from its first request to its
last committed conversation, output written and fsynced; plain: the `generate` call).

Each contender runs in a fresh process (no warm state carried from one to the next), alternating
(vx plain, plain vx, ...) over --reps; the ratio is of the medians.

Prompts: the first-turn ShareGPT prompts in ../shared/data/chat/sharegpt_prompts.jsonl (exits
saying so when absent), rendered with the embedded model's chat template; greedy, --max-tokens.

    python bench/regenerate.py [--prompts 200] [--max-tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ROOT.parent / "shared" / "data" / "chat" / "sharegpt_prompts.jsonl"


def read_rows(n: int) -> list[dict]:
    return [json.loads(x) for x in PROMPTS.read_bytes().split(b"\n") if x.strip()][:n]


def run_vx(rows: list[dict], max_tokens: int) -> dict:
    from vx.jobs.config import RegenConfig
    from vx.jobs.regenerate import run_regenerate
    from vx.data.tiny import default_model_dir

    with tempfile.TemporaryDirectory(prefix="vx-bench-regen-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        s = run_regenerate(RegenConfig(data=str(data), output=Path(tmp) / "regen.jsonl", model=str(default_model_dir()),
                                       turns="last", max_tokens=max_tokens), progress=False)
    return {"generated_tokens": s["generated_tokens"], "s": s["generate_s"]}


def run_plain(rows: list[dict], max_tokens: int) -> dict:
    from vx.data.chat import ChatTemplate, conversation
    from vx.data.model import load_tokenizer
    from vx.data.tiny import default_model_dir

    model = default_model_dir()
    tok = load_tokenizer(model)
    chat = ChatTemplate(tok)
    prompts = []
    for r in rows:
        msgs = [m for m in conversation(r.get("messages") or r["conversations"]) if m["role"] != "assistant"]
        prompts.append({"prompt_token_ids": tok(chat.render(msgs, gen=True), add_special_tokens=False)["input_ids"]})
    from vllm import LLM, SamplingParams

    from vx.engine.vllm_engine import stop_engine_core

    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
              enable_prefix_caching=True, seed=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    plain_s = time.perf_counter() - t
    stop_engine_core(llm.llm_engine)
    return {"generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "s": round(plain_s, 3)}


def one(contender: str, prompts: int, max_tokens: int) -> dict:
    """One contender in a fresh process; its result is the last stdout line."""
    p = subprocess.run([sys.executable, __file__, "--contender", contender, "--prompts", str(prompts),
                        "--max-tokens", str(max_tokens)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True, env=os.environ, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["tokens_per_s"] = round(r["generated_tokens"] / r["s"], 1)
    print(f"  {contender:5s} {r['tokens_per_s']:8.1f} generated tokens/s ({r['generated_tokens']} in {r['s']:.2f} s)",
          file=sys.stderr)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--contender", choices=["vx", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not PROMPTS.exists():
        raise SystemExit(f"bench/regenerate.py needs {PROMPTS} (../shared beside the checkout); it is absent here")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # what vx sets for its own engine
    if args.contender:
        run = run_vx if args.contender == "vx" else run_plain
        print(json.dumps(run(read_rows(args.prompts), args.max_tokens)))
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from common import interleaved, write_result

    runs = interleaved(args.reps, {c: (lambda c=c: one(c, args.prompts, args.max_tokens)) for c in ("vx", "plain")},
                       alternate=True)
    med = {c: statistics.median(r["tokens_per_s"] for r in rs) for c, rs in runs.items()}
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "reps": args.reps,
              "vx": {"tokens_per_s_median": med["vx"], "runs": runs["vx"]},
              "plain": {"tokens_per_s_median": med["plain"], "runs": runs["plain"]},
              "ratio": round(med["vx"] / med["plain"], 3)}
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('regenerate', result)}", file=sys.stderr)


if __name__ == "__main__":
    main()
