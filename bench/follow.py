"""Train while extracting (follow) vs extract, then train: on the same data, in one run.

Three contenders over the same real conversations (../shared), each from an empty output:
  sequential:  `vx extract`, then `examples/train_draft.py` for one epoch;
  follow:      both started together, the trainer with --follow;
  follow+retain: the same, `vx extract --retain-gb` (the trainer commits every --every steps).
Reported: seconds to the first training step (from the extraction's start), end-to-end seconds
(until the trainer's epoch ends), and the high-water mark of shard bytes in the output (sampled
every 50 ms).

    python bench/follow.py [--samples 1500] [--retain-gb 0.02] [--backend hf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import REAL_CHAT, write_result  # noqa: E402


def shard_bytes(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.startswith(("shard-", ".shard-")):
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except OSError:
                    pass
    return total


def run(name: str, data: Path, work: Path, args, follow: bool, retain: float | None) -> dict:
    out, trace = work / name / "out", work / name / "trace"
    (work / name).mkdir(parents=True)
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    extract = [sys.executable, "-m", "vx", "extract", str(data), "-o", str(out), "--backend", args.backend,
               "--shard-size", str(args.shard_mb), "--json"] + (["--retain-gb", str(retain)] if retain else [])
    train = [sys.executable, str(ROOT / "examples" / "train_draft.py"), str(out), "--epochs", "1",
             "--steps", "100000000", "--tokens-per-batch", str(args.tokens_per_batch), "--trace", str(trace),
             "--checkpoint", str(work / name / "ckpt"), "--every", str(args.every)] + (["--follow"] if follow else [])
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], shard_bytes(out))
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.time()
    ex = subprocess.Popen(extract, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if follow:
        tr = subprocess.Popen(train, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    summary = json.loads(ex.communicate()[0])
    extract_s = time.time() - t0
    if not follow:
        tr = subprocess.Popen(train, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    result = json.loads(tr.communicate()[0].decode().strip().splitlines()[-1])
    end = time.time() - t0
    stop.set()
    steps = [json.loads(line) for line in open(f"{trace}.rank0")]
    trained = {s for e in steps if not e["padding"] for s in e["sample_ids"]}
    return {"first_step_s": round(steps[0]["time"] - t0, 2), "end_to_end_s": round(end, 2),
            "extract_s": round(extract_s, 2), "storage_peak_bytes": peak[0], "output_bytes": summary["bytes_written"],
            "samples": summary["samples"], "tokens": summary["tokens"], "steps": result["steps"],
            "trained_samples": len(trained), "retain_gb": retain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--retain-gb", type=float, default=0.3)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not REAL_CHAT.exists():
        raise SystemExit(f"bench needs {REAL_CHAT} (shared/ beside the checkout)")
    with tempfile.TemporaryDirectory(prefix="vx-bench-follow-") as d:
        work = Path(d)
        data = work / "data.jsonl"
        rows = REAL_CHAT.read_text().splitlines()[: args.samples]
        data.write_text("\n".join(rows) + "\n")
        contenders = {
            "sequential": run("sequential", data, work, args, follow=False, retain=None),
            "follow": run("follow", data, work, args, follow=True, retain=None),
            "follow_retain": run("follow_retain", data, work, args, follow=True, retain=args.retain_gb),
        }
    seq = contenders["sequential"]
    result = {"samples": args.samples, "backend": args.backend, "model": "embedded tiny (vx extract's default)",
              "shard_mb": args.shard_mb, "contenders": contenders,
              "first_step_speedup": round(seq["first_step_s"] / contenders["follow"]["first_step_s"], 2),
              "end_to_end_speedup": round(seq["end_to_end_s"] / contenders["follow"]["end_to_end_s"], 2),
              "storage_ratio_retain": round(contenders["follow_retain"]["storage_peak_bytes"] / seq["storage_peak_bytes"],
                                            3)}
    path = write_result("follow", result, args.out)
    print(json.dumps(result, indent=2))
    print(f"-> {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
