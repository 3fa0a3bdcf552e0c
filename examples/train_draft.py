"""Train a small draft head on a vx output through `vx.loader`: the shape of a DFlash / EAGLE-3
drafter. The target's hidden states at the extracted layers, concatenated per token, are
projected to the draft width and added to the token embedding; one decoder layer (causal
attention inside each packed sample, via cu_seqlens); an LM head predicts the next token, with
loss on the assistant tokens (loss_mask).

  python examples/train_draft.py out/ --steps 100
  torchrun --nproc_per_node 2 examples/train_draft.py out/ --steps 100      # DDP (gloo on CPU, nccl on GPU)
  python examples/train_draft.py s3://bucket/run1 --endpoint-url http://... --cache-gb 50
  # while `vx extract ... -o out/` runs: train on shards as they are committed, checkpoint every
  # 50 steps (and tell `vx extract --retain-gb` what is consumed), resume after a crash
  torchrun --nproc_per_node 2 examples/train_draft.py out/ --follow --checkpoint ckpt/ --every 50

Rank 0 prints one JSON line at the end: the first step's loss and the mean of the last 10.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import vx


class DraftHead(nn.Module):
    def __init__(self, features: int, vocab: int, width: int = 128, heads: int = 4):
        super().__init__()
        self.proj = nn.Linear(features, width)
        self.embed = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.proj(hidden.float()) + self.embed(input_ids)        # [T, D]
        x = self.layer(x[None], src_mask=packed_causal_mask(cu_seqlens, x.shape[0], x.device))[0]
        return self.head(self.norm(x))                                 # [T, V]


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """[T, T] True where attention is not allowed: across samples, or to the future."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=device),
                                  (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    pos = torch.arange(total, device=device)
    return (seg[:, None] != seg[None, :]) | (pos[None, :] > pos[:, None])


def next_token_loss(logits, input_ids, loss_mask, cu_seqlens) -> torch.Tensor:
    """Predict token t+1 from position t, inside each sample, where t+1 is an assistant token."""
    last = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    last[(cu_seqlens[1:] - 1).long()] = True                       # no next token inside the sample
    keep = ~last[:-1] & loss_mask[1:].bool()
    if not keep.any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits[:-1][keep], input_ids[1:][keep])


def vocab_size(meta: dict, default: int = 1 << 16) -> int:
    cfg = Path(meta.get("model", "")) / "config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        return int((c.get("text_config") or c).get("vocab_size", default))
    return default


class Checkpoints:
    """One file per rank and step, written atomically; resume from the latest step every rank saved."""

    def __init__(self, root: str, rank: int, world: int, keep: int = 2):
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.root.mkdir(parents=True, exist_ok=True)

    def _steps(self, rank: int) -> set[int]:
        return {int(p.name.split("-")[1]) for p in self.root.glob(f"step-*-rank{rank}.pt")}

    def load(self) -> dict | None:
        common = set.intersection(*(self._steps(r) for r in range(self.world)))
        if not common:
            return None
        return torch.load(self.root / f"step-{max(common):08d}-rank{self.rank}.pt", weights_only=False)

    def save(self, step: int, state: dict) -> None:
        path = self.root / f"step-{step:08d}-rank{self.rank}.pt"
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        for old in sorted(self._steps(self.rank))[:-self.keep]:
            (self.root / f"step-{old:08d}-rank{self.rank}.pt").unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="vx output: a directory or s3://bucket/prefix")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens-per-batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--cache-gb", type=float, default=20.0)
    ap.add_argument("--follow", action="store_true", help="train while vx extract writes the output (first epoch)")
    ap.add_argument("--follow-timeout", type=float, default=1800.0)
    ap.add_argument("--shuffle-shards", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=None, help="stop after this many epochs (default: --steps)")
    ap.add_argument("--checkpoint", default=None, help="directory: save every --every steps, resume from the latest")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--trace", default=None, help="append one JSON line per step: rank, step, sample ids")
    args = ap.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    data = vx.loader(args.output, tokens_per_batch=args.tokens_per_batch, rank=rank, world_size=world,
                     seed=args.seed, flatten_layers=True, device=device, endpoint_url=args.endpoint_url,
                     cache_gb=args.cache_gb, follow=args.follow, follow_timeout=args.follow_timeout,
                     shuffle_shards=args.shuffle_shards)
    meta = data.meta
    model = DraftHead(len(meta["layer_ids"]) * meta["hidden_size"], vocab_size(meta)).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, step, epoch = [], 0, 0
    ckpt = Checkpoints(args.checkpoint, rank, world) if args.checkpoint else None
    if ckpt is not None and (saved := ckpt.load()) is not None:
        step, epoch = saved["step"], saved["loader"]["epoch"]
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        data.load_state_dict(saved["loader"])
    trace = open(f"{args.trace}.rank{rank}", "a") if args.trace else None
    while step < args.steps and (args.epochs is None or epoch < args.epochs):
        if data.epoch != epoch:
            data.set_epoch(epoch)  # the same number of batches on every rank: no collective hangs
        for batch in data:
            logits = model(batch["hidden_states"], batch["input_ids"], batch["cu_seqlens"])
            loss = next_token_loss(logits, batch["input_ids"], batch["loss_mask"], batch["cu_seqlens"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if trace is not None:
                trace.write(json.dumps({"rank": rank, "step": step, "epoch": epoch, "time": time.time(), "padding": batch["padding"],
                                        "sample_ids": batch["sample_ids"]}) + "\n")
                trace.flush()
            if ckpt is not None and step % args.every == 0:
                state = data.state_dict()
                ckpt.save(step, {"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "loader": state})
                if args.follow:
                    data.commit(state)  # durable now: vx extract --retain-gb may drop what it covers
            if step >= args.steps:
                break
        else:
            epoch += 1
    if rank == 0:
        tail = losses[-10:]
        print(json.dumps({"steps": step, "epochs": epoch, "world_size": world, "first_loss": round(losses[0], 4),
                          "final_loss": round(sum(tail) / len(tail), 4)}))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
