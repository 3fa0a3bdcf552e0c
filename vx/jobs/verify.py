"""`vx verify`: prove an output is intact and right.

1. Every committed shard's size and checksum match the manifest (CRC64-NVME, or an older
   output's sha256); on S3 the checksum S3 computed on receipt, by HEAD requests only.
2. N random committed samples are recomputed with the HF reference (batch 1, hooks; fp32 when it
   fits this machine's free memory, else bf16: vx/engine/reference.py) on the model recorded in vx.json
   (or --model) and compared per layer: cosine and max |diff| against the reference's bound.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from vx.errors import UsageError
from vx.store import checksum
from vx.store.reader import open_dataset
from vx.store.stream import Stream


@dataclass
class VerifyReport:
    shards_checked: int = 0
    bad_shards: list[str] = field(default_factory=list)
    dropped_shards: int = 0  # deleted by --retain-gb once consumed: not checked, not sampled
    duplicate_ids: list[str] = field(default_factory=list)  # committed more than once
    samples: list[dict] = field(default_factory=list)  # {id, layer, cosine, max_abs_diff, rel_diff, ok}
    min_cosine: float = 1.0
    max_rel_diff: float | None = None
    reference: str = ""  # the reference's device and dtype, and why

    def worst_by_layer(self) -> list[dict]:
        """Per layer: the worst cosine and max |diff| over the recomputed samples, and where."""
        worst: dict[int, dict] = {}
        for s in self.samples:
            w = worst.setdefault(s["layer"], {"layer": s["layer"], "min_cosine": 1.0, "max_abs_diff": 0.0,
                                              "max_rel_diff": 0.0, "worst_sample": s["id"]})
            if s["cosine"] < w["min_cosine"]:
                w.update(min_cosine=s["cosine"], worst_sample=s["id"])
            w["max_abs_diff"] = max(w["max_abs_diff"], s["max_abs_diff"])
            w["max_rel_diff"] = max(w["max_rel_diff"], s["rel_diff"])  # what the bound holds
        return list(worst.values())

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.duplicate_ids and all(r["ok"] for r in self.samples)


def verify(out: str | Path, model: str | None = None, samples: int = 8, min_cosine: float | None = None,
           seed: int = 0, endpoint_url: str | None = None, device: str | None = None) -> VerifyReport:
    """min_cosine None: the reference's bound (vx/engine/reference.py) for this model, reference dtype
    and store dtype. device None: cuda when available, else cpu."""
    if str(out).startswith("s3://"):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vx-verify-") as tmp:
            return _verify(Path(tmp), model, samples, min_cosine, seed, device, remote=(str(out), endpoint_url))
    return _verify(Path(out), model, samples, min_cosine, seed, device)


def _verify(out: Path, model, samples, min_cosine, seed, device, remote=None) -> VerifyReport:
    client = target = None
    if remote is not None:  # S3: manifest and vx.json come down; shards are checked in place
        from vx.store.s3_client import make_client, parse_s3_url
        from vx.store.s3 import fetch_layout_meta

        target, client = parse_s3_url(remote[0]), make_client(remote[1])
        fetch_layout_meta(client, target, out)
    ds = open_dataset(out)
    if not ds.meta:
        raise UsageError(f"{out} is not a vx output directory (no vx.json)")
    report = VerifyReport(min_cosine=min_cosine if min_cosine is not None else 1.0)
    seen: set[str] = set()
    report.duplicate_ids = sorted({sid for sid in ds.ids if sid in seen or seen.add(sid)})
    src = Stream(str(out))
    dropped = src.dropped([""] + src.src.partitions())
    for rec in ds.shards:
        if rec["shard"] in dropped:
            report.dropped_shards += 1
            continue
        report.shards_checked += 1
        if client is not None:
            try:
                # the checksum S3 computed on receipt: a HEAD, no body downloaded
                ok = checksum.head_ok(checksum.head(client, target.bucket, target.key(rec["shard"])), rec)
            except Exception:
                ok = False
        else:
            path = out / rec["shard"]
            ok = path.exists() and path.stat().st_size == rec["bytes"] and checksum.file_ok(path, rec)
        if not ok:
            report.bad_shards.append(rec["shard"])
    if samples <= 0 or not len(ds) or report.dropped_shards == len(ds.shards):
        return report
    from vx.data.model import resolve_model
    from vx.engine.reference import Bound, Reference

    ref = Reference(resolve_model(model or ds.meta["model"]), ds.layer_ids, ds.meta.get("model_type", "?"),
                    ds.meta.get("store_dtype", "bf16"), device)
    if min_cosine is not None:  # the user's bound replaces the reference's (cosine only)
        ref.bound = Bound(min_cosine, float("inf"))
    report.min_cosine = ref.bound.min_cosine
    report.max_rel_diff = None if min_cosine is not None else ref.bound.max_rel_diff
    report.reference = ref.why
    kept = [i for i in range(len(ds)) if ds.shards[ds._loc[i][0]]["shard"] not in dropped]
    for i in sorted(random.Random(seed).sample(kept, min(samples, len(kept)))):
        if client is not None:  # fetch the sample's shard, then check its bytes against the manifest
            rec = ds.shards[ds._loc[i][0]]
            path = out / rec["shard"]
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(target.bucket, target.key(rec["shard"]), str(path))
                if not checksum.file_ok(path, rec) and rec["shard"] not in report.bad_shards:
                    report.bad_shards.append(rec["shard"])
        item = ds[i]
        report.samples += ref.check(item["id"], item["input_ids"].tolist(), item["hidden_states"])
    ref.close()
    return report
