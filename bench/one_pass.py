"""One pass against two: `vx extract PROMPTS -o OUT --regenerate` against `vx regenerate PROMPTS
-o R.jsonl` followed by `vx extract R.jsonl -o OUT`, run as a user runs them (each command a
fresh process, engine starts included), same prompts, model, engine settings and sampling.

Contenders: one-pass as vx runs it (on CPU both engines on every core, the capture after the
regeneration's end), one-pass with the cores halved between the engines and the capture following
the regeneration (VX_ONE_PASS_CORES=split, --modes one-pass,one-pass-split-cores,two-pass), and
the two commands.
Reported per contender, medians over interleaved reps (order reversed every rep): end-to-end wall
time, and the engines' busy time from the commands' own summaries (the regeneration's generate_s,
the extraction's extract_s). Prompts: the first-turn ShareGPT prompts in ../shared/data/chat
(exits saying so when absent); model: the tiny random hybrid GDN bench model with the real
Qwen3.6 vocabulary; greedy, --max-tokens per turn.

    python bench/one_pass.py [--prompts 128] [--max-tokens 128] [--reps 3]
    python bench/one_pass.py --model /models/other --skip 700   # another model, other prompts

Writes bench/results/one_pass-<device>-<date>-<time>.json (one file per run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, bench_model, write_result  # noqa: E402

PROMPTS = ROOT.parent / "shared" / "data" / "chat" / "sharegpt_prompts.jsonl"


def vx(*args: str) -> dict:
    """A `vx` command as a user runs it: this interpreter's `vx` script (`python -m vx` where there is none)."""
    script = Path(sys.executable).with_name("vx")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "vx"]
    r = subprocess.run([*cmd, *args, "--json"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"vx {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def two_pass(data: Path, work: Path, gen: list[str], model: str) -> dict:
    t = time.perf_counter()
    regen = vx("regenerate", str(data), "-o", str(work / "regen.jsonl"), "--model", model, *gen)
    ex = vx("extract", str(work / "regen.jsonl"), "-o", str(work / "out"), "--model", model, "--backend", "vllm")
    wall = time.perf_counter() - t
    return {"wall_s": wall, "generate_s": regen["generate_s"], "extract_s": ex["extract_s"],
            "samples": ex["samples"], "tokens": ex["tokens"], "generated_tokens": regen["generated_tokens"]}


CORES = {"one-pass": {}, "one-pass-split-cores": {"VX_ONE_PASS_CORES": "split"}}  # the engines' CPU layouts


def one_pass(data: Path, work: Path, gen: list[str], model: str, name: str = "one-pass") -> dict:
    os.environ.pop("VX_ONE_PASS_CORES", None)
    os.environ.update(CORES[name])
    t = time.perf_counter()
    ex = vx("extract", str(data), "-o", str(work / "out"), "--model", model, "--backend", "vllm", "--regenerate", *gen)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "generate_s": ex["regenerated"]["generate_s"], "extract_s": ex["extract_s"],
            "samples": ex["samples"], "tokens": ex["tokens"], "generated_tokens": ex["regenerated"]["generated_tokens"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", help="a local HF model directory (default: the bench model)")
    ap.add_argument("--skip", type=int, default=0, help="start at this prompt (held-out prompts)")
    ap.add_argument("--modes", default="one-pass,two-pass",
                    help=f"contenders, of {', '.join([*CORES, 'two-pass'])}")
    args = ap.parse_args(argv)
    if not PROMPTS.exists():
        raise SystemExit(f"bench needs {PROMPTS} (shared/ beside the checkout)")
    model = args.model or str(bench_model())
    rows = [json.loads(x) for x in PROMPTS.read_bytes().split(b"\n") if x.strip()][args.skip:args.skip + args.prompts]
    gen = ["--max-tokens", str(args.max_tokens), "--turns", "last"]
    runs: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    if "two-pass" not in runs or any(m not in CORES for m in runs if m != "two-pass"):
        raise SystemExit(f"--modes: two-pass and any of {', '.join(CORES)}")
    with tempfile.TemporaryDirectory(prefix="vx-bench-one-pass-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for rep in range(args.reps):
            order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
            for name in order:
                work = Path(tmp) / f"{name}-{rep}"
                work.mkdir()
                if name == "two-pass":
                    r = two_pass(data, work, gen, model)
                else:
                    r = one_pass(data, work, gen, model, name)
                runs[name].append(r)
                shutil.rmtree(work)
                print(f"rep {rep} {name:9s} {r['wall_s']:7.1f}s (generate {r['generate_s']:.1f}s, "
                      f"extract {r['extract_s']:.1f}s)", file=sys.stderr)
    table = {}
    for name, rs in runs.items():
        table[name] = {k: round(statistics.median(r[k] for r in rs), 2) for k in ("wall_s", "generate_s", "extract_s")}
        table[name].update(samples=rs[0]["samples"], generated_tokens=rs[0]["generated_tokens"],
                           wall_s_runs=[round(r["wall_s"], 2) for r in rs])
    speedup = {k: round(table["two-pass"]["wall_s"] / table[k]["wall_s"], 3) for k in runs if k != "two-pass"}
    per_rep = {k: [round(t["wall_s"] / o["wall_s"], 3) for o, t in zip(runs[k], runs["two-pass"])]
               for k in runs if k != "two-pass"}
    import torch

    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "cores": len(os.sched_getaffinity(0)), "model": model, "prompts": len(rows), "first_prompt": args.skip,
              "max_tokens": args.max_tokens, "reps": args.reps, "modes": table,
              "speedup_vs_two_pass": speedup, "speedup_vs_two_pass_per_rep": per_rep}
    print(json.dumps(result, indent=1))
    print(f"wrote {write_result('one_pass', result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
