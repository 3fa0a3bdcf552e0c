"""Scale-out benchmark: one engine vs `--data-parallel-size N` on the same real conversations.

Runs `vx extract` (the real CLI, vLLM backend) single-process and data-parallel, interleaved,
on N real conversations from shared/ with the embedded tiny model, and prints the extraction
window (first sample to last engine's end, model loads excluded), the wall time of the whole
command, the token spread across partitions and the spread of their finish times.
On a CPU machine the engines split the cores, so the ratio measures vx's overhead and balance,
not extra hardware; on a GPU node each engine gets its own GPU.

  python bench/scale_out.py --samples 300 --dp 2 --reps 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REAL_CHAT, ROOT, interleaved, write_result


def run(data: Path, out: Path, dp: int, max_length: int) -> dict:
    cmd = [sys.executable, "-m", "vx", "extract", str(data), "-o", str(out), "--backend", "vllm",
           "--max-length", str(max_length), "--json"] + (["--dp", str(dp)] if dp > 1 else [])
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    s = json.loads(r.stdout)
    s["wall_s"] = time.perf_counter() - t
    shutil.rmtree(out)
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="single and data-parallel runs, interleaved; medians")
    ap.add_argument("--max-length", type=int, default=2048)
    args = ap.parse_args(argv)
    if not REAL_CHAT.exists():
        raise SystemExit(f"needs {REAL_CHAT} (shared/ beside the checkout)")
    tmp = Path(tempfile.mkdtemp(prefix="vx-scale-"))
    data = tmp / "data.jsonl"
    data.write_text("".join(REAL_CHAT.read_text().splitlines(keepends=True)[: args.samples]))
    try:
        runs = interleaved(args.reps, {"single": lambda: run(data, tmp / "single", 1, args.max_length),
                                       "dp": lambda: run(data, tmp / "dp", args.dp, args.max_length)})
        singles, parallels = runs["single"], runs["dp"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    tokens = parallels[-1]["balance"]["tokens"]
    res = {
        "samples": args.samples, "tokens": singles[0]["tokens"], "dp": args.dp, "reps": args.reps,
        "single_extract_s": round(med(singles, "extract_s"), 2), "dp_extract_s": round(med(parallels, "extract_s"), 2),
        "single_wall_s": round(med(singles, "wall_s"), 2), "dp_wall_s": round(med(parallels, "wall_s"), 2),
        "single_tokens_per_s": round(med(singles, "tokens_per_s")), "dp_tokens_per_s": round(med(parallels, "tokens_per_s")),
        "partition_tokens": tokens, "token_spread": parallels[-1]["balance"]["token_spread"],
        "finish_spread_s": [p["balance"]["finish_spread_s"] for p in parallels],
        "plan_s": parallels[-1]["balance"]["plan_s"],
    }
    res["extract_speedup"] = round(res["single_extract_s"] / res["dp_extract_s"], 3)
    res["wall_speedup"] = round(res["single_wall_s"] / res["dp_wall_s"], 3)
    print(json.dumps(res))
    dest = write_result("scale_out", res)
    print(f"wrote {dest}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
