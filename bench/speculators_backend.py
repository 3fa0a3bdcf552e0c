"""speculators' dataset rows through vx's backend vs through speculators' own file backend.

    python bench/speculators_backend.py [--samples 64] [--reps 3]

The same rows of one vx output (the embedded default, --layers speculators-dflash, bf16), read
by speculators' ArrowDataset (`ds[i]` for every row, in order) two ways: the `vx` backend over
the output's shards (zero-copy mmap, sha256 of each shard on first use), and speculators' `file`
backend over one `hs_<i>.safetensors` per row, written here from the same states (what a user
would convert to today). Both with a warm page cache; best of --reps. Samples/s, tokens/s, GB/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def epoch(dataset) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    tokens = nbytes = 0
    for i in range(len(dataset)):
        row = dataset[i]
        tokens += row["input_ids"].numel()
        nbytes += sum(row[k].numel() * row[k].element_size() for k in ("hidden_states", "verifier_last_hidden_states"))
    return time.perf_counter() - t0, tokens, nbytes


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch
    from common import interleaved, write_result
    from hs_connectors import FileTransfer
    from safetensors.torch import save_file
    from speculators.train.data import ArrowDataset

    import vx
    from vx.train.speculators import VxTransfer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [json.loads(line) for line in open(ROOT / "examples" / "chat.jsonl")][: args.samples]
        (tmp / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for cmd in (["extract", str(tmp / "d.jsonl"), "-o", str(tmp / "out"), "--backend", "hf", "--layers",
                     "speculators-dflash"], ["export", str(tmp / "out"), "--to", "speculators", "-o", str(tmp / "idx")]):
            subprocess.run([sys.executable, "-m", "vx", *cmd], check=True, capture_output=True)
        ours = ArrowDataset(max_len=1 << 16, datapath=str(tmp / "idx"), transfer=VxTransfer(tmp / "idx"),
                            on_missing="raise")
        files = tmp / "hs"  # speculators' file layout, from the same states
        files.mkdir()
        ds, src = vx.open_dataset(tmp / "out"), json.loads((tmp / "idx" / "vx-source.json").read_text())
        pos = [ds.layer_ids.index(k) for k in src["layer_ids"]]
        for i, sid in enumerate(ours.data.with_format(None)["vx_id"]):
            item = ds[sid]
            save_file({"hidden_states": item["hidden_states"][:, pos].contiguous(),
                       "token_ids": item["input_ids"].long()}, str(files / f"hs_{i}.safetensors"))
        theirs = ArrowDataset(max_len=1 << 16, datapath=str(tmp / "idx"), transfer=FileTransfer(files),
                              on_missing="raise")
        assert all(torch.equal(ours[i]["hidden_states"], theirs[i]["hidden_states"]) for i in (0, len(ours) - 1))
        runs = interleaved(args.reps, {"vx": lambda: epoch(ours), "file": lambda: epoch(theirs)})
        best = {name: min(r) for name, r in runs.items()}  # (seconds, tokens, bytes) of the fastest rep
    result = {name: {"samples_per_s": round(len(ours) / s, 1), "tokens_per_s": round(t / s),
                     "gb_per_s": round(b / s / 1e9, 3)} for name, (s, t, b) in best.items()}
    result.update(samples=len(ours), tokens=best["vx"][1], reps=args.reps,
                  vx_over_file=round(best["file"][0] / best["vx"][0], 3))
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('speculators', result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
