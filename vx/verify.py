"""`vx verify`: prove an output is intact and right.

1. Every committed shard's size and sha256 match the manifest.
2. N random committed samples are recomputed with the HF reference (fp32, batch 1, hooks) on
   the model recorded in vx.json (or --model) and compared per layer: cosine and max |diff|.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import UsageError
from .reader import open_dataset


@dataclass
class VerifyReport:
    shards_checked: int = 0
    bad_shards: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # {id, layer, cosine, max_abs_diff}
    min_cosine: float = 1.0

    @property
    def ok(self) -> bool:
        return not self.bad_shards and all(r["ok"] for r in self.samples)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(out: Path, model: str | None = None, samples: int = 8, min_cosine: float = 0.999,
           seed: int = 0) -> VerifyReport:
    ds = open_dataset(out)
    if not ds.meta:
        raise UsageError(f"{out} is not a vx output directory (no vx.json)")
    report = VerifyReport(min_cosine=min_cosine)
    for rec in ds.shards:
        path = Path(out) / rec["shard"]
        report.shards_checked += 1
        if not path.exists() or path.stat().st_size != rec["bytes"] or sha256_file(path) != rec["sha256"]:
            report.bad_shards.append(rec["shard"])
    if samples <= 0 or not len(ds):
        return report
    from .dataset import Sample
    from .hf_backend import HFExtractor, load_hf_model
    from .model import resolve_model

    model_dir = resolve_model(model or ds.meta["model"])
    hf = load_hf_model(model_dir, "float32", "cpu")
    ex = HFExtractor(hf, ds.layer_ids)
    for i in sorted(random.Random(seed).sample(range(len(ds)), min(samples, len(ds)))):
        item = ds[i]
        ids = item["input_ids"].tolist()
        ref = ex.extract([Sample(item["id"], 0, ids, [])])[0].float()  # [T, L, H]
        got = item["hidden_states"].float()
        for j, k in enumerate(ds.layer_ids):
            cos = torch.nn.functional.cosine_similarity(got[:, j].flatten(), ref[:, j].flatten(), dim=0).item()
            diff = (got[:, j] - ref[:, j]).abs().max().item()
            report.samples.append({"id": item["id"], "layer": k, "cosine": cos, "max_abs_diff": diff,
                                   "ok": cos >= min_cosine})
    ex.remove()
    return report
