"""Train a small draft head on a vx output through `vx.loader`: the shape of a DFlash / EAGLE-3
drafter. The target's hidden states at the extracted layers, concatenated per token, are
projected to the draft width and added to the token embedding; one decoder layer (causal
attention inside each packed sample, via cu_seqlens); an LM head predicts the next token, with
loss on the assistant tokens (loss_mask).

  python examples/train_draft.py out/ --steps 100
  torchrun --nproc_per_node 2 examples/train_draft.py out/ --steps 100      # DDP (gloo on CPU, nccl on GPU)
  python examples/train_draft.py s3://bucket/run1 --endpoint-url http://... --cache-gb 50

Rank 0 prints one JSON line at the end: the first step's loss and the mean of the last 10.
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="vx output: a directory or s3://bucket/prefix")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens-per-batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--cache-gb", type=float, default=20.0)
    args = ap.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    data = vx.loader(args.output, tokens_per_batch=args.tokens_per_batch, rank=rank, world_size=world,
                     seed=args.seed, flatten_layers=True, device=device, endpoint_url=args.endpoint_url,
                     cache_gb=args.cache_gb)
    meta = data.meta
    model = DraftHead(len(meta["layer_ids"]) * meta["hidden_size"], vocab_size(meta)).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, step, epoch = [], 0, 0
    while step < args.steps:
        data.set_epoch(epoch)  # the same number of batches on every rank: no collective hangs
        for batch in data:
            logits = model(batch["hidden_states"], batch["input_ids"], batch["cu_seqlens"])
            loss = next_token_loss(logits, batch["input_ids"], batch["loss_mask"], batch["cu_seqlens"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        tail = losses[-10:]
        print(json.dumps({"steps": step, "epochs": epoch, "world_size": world, "first_loss": round(losses[0], 4),
                          "final_loss": round(sum(tail) / len(tail), 4)}))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
