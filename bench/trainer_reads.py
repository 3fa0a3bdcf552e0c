"""SpecForge's and ModelOpt's own sample readers over a vx output vs over their own per-sample files.

    python bench/trainer_reads.py [--mb 800] [--hidden 5120] [--reps 3]

A synthetic vx output (vx's ShardWriter, random bf16 states, 5 layers of a 27B-shaped hidden size,
~335 tokens per sample) is read sample by sample through each trainer's own entry point:
- SpecForge: `feature_store.load_feature_file` (vx.train.specforge installed), a vx row path vs
  its own `.ckpt` file (torch.save, read by its torch.load with mmap);
- ModelOpt: `OfflineSupervisedDataset[i]` (vx.train.modelopt installed), a vx row path vs its own
  `.pt` file (torch.save, read by its torch.load).
Each record's states are copied into one buffer, as a collator does, so that every byte is read.
Warm page cache for every contender; best of --reps. Samples/s, GB/s of states, and the bytes
and files each layout takes on disk. The files are written here from the same states.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
LAYERS = 5


def write_output(out: Path, target_bytes: int, hidden: int) -> int:
    from vx.store.output import prepare_output
    from vx.store.writer import ShardWriter

    meta = {"format": "vx-1", "model": "synthetic", "model_fingerprint": "bench", "num_layers": LAYERS,
            "layer_ids": list(range(LAYERS)), "hidden_size": hidden, "store_dtype": "bf16"}
    state = prepare_output(out, meta, overwrite=True)
    w = ShardWriter(out, {"model": "synthetic"}, 512 << 20, state.next_shard, LAYERS, hidden, "bf16")
    g = torch.Generator().manual_seed(0)
    block = torch.randn(1024, LAYERS, hidden, generator=g).to(torch.bfloat16)
    total = n = 0
    while total < target_bytes:
        t = int(torch.randint(16, 670, (1,), generator=g))
        w.add(f"s{n}", list(range(t)), [1] * t, block[:t])
        total, n = total + t * LAYERS * hidden * 2, n + 1
    w.close()
    return n


def timed(get, n: int, key, buf: torch.Tensor) -> tuple[float, int]:
    t0, nbytes = time.perf_counter(), 0
    for i in range(n):
        h = key(get(i))
        flat = h.reshape(-1)
        buf[:flat.numel()].copy_(flat)  # what a collator's copy into its padded batch reads
        nbytes += flat.numel() * flat.element_size()
    return time.perf_counter() - t0, nbytes


def disk(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=800)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from common import interleaved, write_result
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    import vx
    from vx.train import modelopt, specforge

    specforge.install()
    modelopt.install()
    from specforge.runtime.data_plane.feature_store import load_feature_file

    with tempfile.TemporaryDirectory(dir=ROOT.parent if (ROOT.parent / "shared").exists() else None) as tmp:
        tmp = Path(tmp)
        out = tmp / "out"
        n = write_output(out, args.mb << 20, args.hidden)
        ds = vx.open_dataset(out)
        sf_dir, mo_dir = tmp / "specforge" / f"rows_0-{n}", tmp / "modelopt"
        sf_dir.mkdir(parents=True)
        mo_dir.mkdir()
        draft = list(range(LAYERS - 1))  # the last layer is ModelOpt's hidden_states
        for i, sid in enumerate(ds.ids):
            item = ds[sid]
            h = item["hidden_states"]
            torch.save({"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].long(),
                        "hidden_states": h[:, draft].reshape(1, h.shape[0], -1).clone()}, sf_dir / f"data_{i:06d}.ckpt")
            torch.save({"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].long(),
                        "hidden_states": h[:, -1].clone(), "aux_hidden_states": h[:, draft].reshape(h.shape[0], -1).clone(),
                        "hidden_states_prenorm": True, "conversation_id": sid}, mo_dir / f"{sid}.pt")
        specforge.use_layers(draft)
        modelopt.use_layers(draft)
        sf_vx = specforge.list_feature_files(str(out))
        sf_files = sorted(str(p) for p in sf_dir.glob("*.ckpt"))
        mo_vx = OfflineSupervisedDataset(modelopt.dumped_files(str(out)))
        mo_files = OfflineSupervisedDataset(sorted(str(p) for p in mo_dir.glob("*.pt")))
        assert torch.equal(load_feature_file(sf_vx[0])["hidden_states"], load_feature_file(sf_files[0])["hidden_states"])
        assert torch.equal(mo_vx[0]["aux_hidden_states"], mo_files[0]["aux_hidden_states"])
        buf = torch.empty(1024 * LAYERS * args.hidden, dtype=torch.bfloat16)
        contenders = {
            "specforge_vx": (lambda i: load_feature_file(sf_vx[i]), lambda r: r["hidden_states"]),
            "specforge_files": (lambda i: load_feature_file(sf_files[i]), lambda r: r["hidden_states"]),
            "modelopt_vx": (mo_vx.__getitem__, lambda r: torch.cat([r["aux_hidden_states"], r["base_model_hidden_states"]], 1)),
            "modelopt_files": (mo_files.__getitem__, lambda r: torch.cat([r["aux_hidden_states"], r["base_model_hidden_states"]], 1)),
        }
        runs = interleaved(args.reps, {name: (lambda g=get, k=key: timed(g, n, k, buf))
                                       for name, (get, key) in contenders.items()})
        best = {name: min(r) for name, r in runs.items()}  # (seconds, bytes) of the fastest rep
        shards = list(out.glob("shard-*"))
        result = {name: {"samples_per_s": round(n / s, 1), "gb_per_s": round(b / s / 1e9, 3)} for name, (s, b) in best.items()}
        result.update(samples=n, hidden=args.hidden, layers=LAYERS, reps=args.reps,
                      specforge_vx_over_files=round(best["specforge_files"][0] / best["specforge_vx"][0], 3),
                      modelopt_vx_over_files=round(best["modelopt_files"][0] / best["modelopt_vx"][0], 3),
                      disk={"vx": {"bytes": disk(shards), "files": len(shards)},
                            "specforge": {"bytes": disk(sf_dir.glob("*.ckpt")), "files": n},
                            "modelopt": {"bytes": disk(mo_dir.glob("*.pt")), "files": n}})
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('trainer_reads', result)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
