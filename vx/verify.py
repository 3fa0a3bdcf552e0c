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
    duplicate_ids: list[str] = field(default_factory=list)  # committed more than once
    samples: list[dict] = field(default_factory=list)  # {id, layer, cosine, max_abs_diff}
    min_cosine: float = 1.0

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.duplicate_ids and all(r["ok"] for r in self.samples)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(out: str | Path, model: str | None = None, samples: int = 8, min_cosine: float = 0.999,
           seed: int = 0, endpoint_url: str | None = None) -> VerifyReport:
    if str(out).startswith("s3://"):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vx-verify-") as tmp:
            return _verify(Path(tmp), model, samples, min_cosine, seed, remote=(str(out), endpoint_url))
    return _verify(Path(out), model, samples, min_cosine, seed)


def _verify(out: Path, model, samples, min_cosine, seed, remote=None) -> VerifyReport:
    client = target = None
    if remote is not None:  # S3: manifest and vx.json come down; shards are checked in place
        from .s3 import fetch_layout_meta, make_client, parse_s3_url

        target, client = parse_s3_url(remote[0]), make_client(remote[1])
        fetch_layout_meta(client, target, out)
    ds = open_dataset(out)
    if not ds.meta:
        raise UsageError(f"{out} is not a vx output directory (no vx.json)")
    report = VerifyReport(min_cosine=min_cosine)
    seen: set[str] = set()
    report.duplicate_ids = sorted({sid for sid in ds.ids if sid in seen or seen.add(sid)})
    for rec in ds.shards:
        report.shards_checked += 1
        if client is not None:
            try:
                head = client.head_object(Bucket=target.bucket, Key=target.key(rec["shard"]))
                ok = head["ContentLength"] == rec["bytes"] and head.get("Metadata", {}).get("sha256") == rec["sha256"]
            except Exception:
                ok = False
        else:
            path = out / rec["shard"]
            ok = path.exists() and path.stat().st_size == rec["bytes"] and sha256_file(path) == rec["sha256"]
        if not ok:
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
        if client is not None:  # fetch the sample's shard, then check its bytes against the manifest
            rec = ds.shards[ds._loc[i][0]]
            path = out / rec["shard"]
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(target.bucket, target.key(rec["shard"]), str(path))
                if sha256_file(path) != rec["sha256"] and rec["shard"] not in report.bad_shards:
                    report.bad_shards.append(rec["shard"])
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
