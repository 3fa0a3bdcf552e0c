"""What fp8 storage costs a drafter: per-channel error, and the same DFlash drafter trained on bf16
and on fp8 states.

    python bench/fp8_drafter.py [--samples 160] [--steps 120] [--draft-vocab 4096]

1. Per-channel error of vx's fp8 (e4m3, one scale per token and layer: amax / 448) against the
   same states in bf16, on outlier channels and on ordinary ones, beside MX-style scales (one per
   32 values) for comparison: relative RMS error per channel (RMS of the error over RMS of the
   channel), the median over ordinary channels and over outlier channels. Data: the synthetic
   residual streams of bench/codec.py (6 outlier channels at 20-100x, 2 massive ones at
   1,000-10,000x on ~2% of tokens) and the bench model's states on real chat samples.
2. The bench model's states (8 layers, hidden 256, the real Qwen3.6 vocabulary, random weights)
   on real chat samples, extracted by `vx extract --backend hf --layers speculators-dflash` in bf16
   and in fp8, exported with `vx export --to speculators`, then the same DFlash drafter trained by
   speculators' own model, loss and loader (its Trainer's step on CPU: autocast bf16, AdamW, grad
   clip 1.0), same seed, same batches, same steps: both loss curves. The drafter's vocabulary is
   the samples' --draft-vocab most frequent tokens, mapped by speculators' own code from a
   token_freq.pt written beside each index (the full 248k-token head does not train on a CPU).
Writes bench/results/fp8-drafter-<device>-<date>-<time>.json and prints both.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codec import model_states, synthetic_states  # noqa: E402
from common import REAL_CHAT, bench_model, write_result  # noqa: E402

DFLASH = ("--speculator-type", "dflash", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
          "--total-seq-len", "512", "--max-anchors", "32", "--block-size", "4", "--num-workers", "0")


def fp8_per_token(x):
    """vx's fp8 (vx/store/encoding.py): e4m3, one scale per token and layer -> dequantized."""
    import torch

    from vx.store.encoding import decode, encode

    q, s = encode(x.to(torch.bfloat16), "fp8")
    return decode(q, s).float()


def fp8_blocks(x, block: int = 32):
    """MX-style: one scale per `block` consecutive values of a token's layer row -> dequantized."""
    import torch

    t, n, h = x.shape
    b = x.reshape(t, n, h // block, block)
    scale = b.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((b / scale).to(torch.float8_e4m3fn).float() * scale).reshape(t, n, h)


def channel_errors(x: np.ndarray) -> dict:
    """x [T, L, H] float32 -> per scheme: the median relative RMS error of ordinary and of outlier
    channels (outliers: a channel's RMS above 10x the median channel's, per layer)."""
    import torch

    ref = torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float()  # what bf16 stores
    rms = ref.pow(2).mean(dim=0).sqrt()  # [L, H]
    outlier = rms > 10 * rms.median(dim=1, keepdim=True).values
    out = {"outlier_channels": int(outlier.sum()), "channels": int(outlier.numel())}
    for name, fn in (("fp8 per token", fp8_per_token), ("fp8 per 32 values", fp8_blocks)):
        err = (fn(ref) - ref).pow(2).mean(dim=0).sqrt() / rms.clamp(min=1e-30)  # [L, H]
        out[name] = {"ordinary_median": float(err[~outlier].median()),
                     "ordinary_p99": float(err[~outlier].quantile(0.99)),
                     "outlier_median": float(err[outlier].median()) if outlier.any() else None}
    return out


def vx(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "vx", *args, "--json"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"vx {args[0]} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def exported(work: Path, model: Path, samples: int) -> dict:
    data = work / "chat.jsonl"
    data.write_text("".join(REAL_CHAT.read_text().splitlines(keepends=True)[:samples]))
    out = {}
    for dtype in ("bf16", "fp8"):
        vx("extract", str(data), "-o", str(work / dtype), "--backend", "hf", "--model", str(model),
           "--layers", "speculators-dflash", "--store-dtype", dtype, "--dtype", "float32")
        info = vx("export", str(work / dtype), "--to", "speculators", "-o", str(work / f"{dtype}-index"))
        out[dtype] = (work / f"{dtype}-index", info)
    token_freq(work / "bf16", [index for index, _ in out.values()])
    return out


def token_freq(output: Path, indexes: list[Path]) -> None:
    """speculators' token_freq.pt (token id -> count over the samples' tokens) beside each index:
    from it, its trainer builds the draft vocabulary `--draft-vocab-size` asks for."""
    import torch

    import vx as vx_api

    ds = vx_api.open_dataset(output)
    counts: dict[int, int] = {}
    for sid in ds.ids:
        ids, _ = ds.tokens(sid)
        for t, c in zip(*np.unique(ids.numpy(), return_counts=True)):
            counts[int(t)] = counts.get(int(t), 0) + int(c)
    for index in indexes:
        torch.save(counts, index / "token_freq.pt")


def train(index: Path, model_dir: Path, target: list[int], steps: int, seed: int, vocab: int) -> list[float]:
    """speculators' DFlash drafter, loader and loss; the loop is its Trainer's step on CPU."""
    import torch
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    import vx.train.speculators  # noqa: F401  (registers the backend)

    torch.manual_seed(seed)
    args = argparse.Namespace(**TrainConfig.resolve([
        "--verifier-name-or-path", str(model_dir), "--data-path", str(index), "--hidden-states-backend", "vx",
        "--target-layer-ids", *map(str, target), "--on-missing", "raise", "--save-path", str(index / "ckpt"),
        "--seed", str(seed), "--draft-vocab-size", str(vocab), *DFLASH]).flatten())
    d2t, t2d, vocab = cli.parse_vocab_mappings(args)
    model_class = cli.SpeculatorModel.registry[args.speculator_type]
    model = cli.build_draft_model(args, model_class, t2d, d2t, vocab)
    transfer = cli.HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    loader, _ = cli.create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=model.config.transformer_layer_config.hidden_size, num_target_layers=len(model.target_layer_ids),
        num_workers=0, prefetch_factor=args.prefetch_factor, preprocess=None, train_data_ratio=args.train_data_ratio,
        seed=seed)
    kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    losses = []
    while len(losses) < steps:
        for batch in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss, _ = model(**batch, **kwargs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(round(loss.item(), 5))
            if len(losses) == steps:
                break
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=160, help="real chat samples extracted for training")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=4096,
                    help="the drafter's vocabulary (the most frequent tokens; the full 248k does not train on a CPU)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = {"device": f"cpu-{platform.machine()}", "channel_error": {
        "outliers (synthetic, 5 x 5120)": channel_errors(synthetic_states(2048)),
        "bench-model (layers 1,3,5,7)": channel_errors(model_states(32))}}
    for data, r in res["channel_error"].items():
        print(data, json.dumps(r))
    model = bench_model(8)
    with tempfile.TemporaryDirectory(prefix="vx-fp8-drafter-") as d:
        runs = exported(Path(d), model, args.samples)
        res["target_layer_ids"] = runs["bf16"][1]["target_layer_ids"]
        res["losses"] = {dtype: train(index, model, info["target_layer_ids"], args.steps, args.seed, args.draft_vocab)
                         for dtype, (index, info) in runs.items()}
    res.update(samples=args.samples, steps=args.steps, seed=args.seed, draft_vocab=args.draft_vocab, seconds=round(time.perf_counter() - t0, 1))
    b, f = res["losses"]["bf16"], res["losses"]["fp8"]
    for k in range(0, len(b), max(1, len(b) // 12)):
        print(f"step {k:4d}  bf16 {b[k]:.4f}  fp8 {f[k]:.4f}")
    last = max(1, len(b) // 10)
    res["last_tenth_mean"] = {"bf16": float(np.mean(b[-last:])), "fp8": float(np.mean(f[-last:]))}
    print(json.dumps(res["last_tenth_mean"]))
    print(f"wrote {write_result('fp8-drafter', res, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
