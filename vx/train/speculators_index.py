"""`vx export OUT --to speculators -o DEST`: speculators' Arrow index of a vx output, no state copied.

The index holds, per sample, `input_ids`, `loss_mask`, `seq_len` (what speculators' `ArrowDataset`
loads) and where the sample lives (`vx_id`, `vx_shard`, `vx_row`); `vx-source.json` beside it
says where the output is and which vx layers the backend (vx/train/speculators.py) hands out, in
speculators' order. A local output is indexed from its ids and masks alone (each shard's checksum
is checked when the backend first reads it). An S3 output is read once, a shard at a time (a few
ahead, each checked against its checksum), to give each row its own digest (`vx_offset`,
`vx_sha256`): the backend can then read a row by ranged GETs of its bytes alone and check it.
A shard that fails its checksum keeps its rows in the index without a digest: they are missing
when read, and speculators' --on-missing decides.
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path

import torch

from vx.errors import UsageError
from vx.store import checksum
from vx.store.reader import ShardFile
from vx.store.remote_rows import row_digest
from vx.train.epoch_plan import Catalog

SOURCE = "vx-source.json"
FORMAT = "vx-speculators-1"


def speculators_layers(stored: list[int], num_layers: int, target: list[int] | None = None) -> list[int]:
    """The vx layers the backend hands out, in speculators' order: the drafter's target layers
    (`target`, vx ids; default every stored layer but the last), then the verifier's last layer."""
    last = num_layers - 1
    if last not in stored:
        raise UsageError(f"the output holds layers {stored}, not {last}: the verifier's last hidden state "
                         "(the output of its last decoder layer) that speculators trains against; extract with "
                         "--layers speculators-dflash (or add it to --layers)")
    drafter = sorted(target) if target is not None else [k for k in stored if k != last]
    missing = [k for k in drafter if k not in stored]
    if missing or not drafter or last in drafter:
        raise UsageError(f"target layers {drafter} must be stored layers other than {last}: the output holds {stored}")
    return drafter + [last]


def export(output: str | Path, dest: str | Path, target: list[int] | None = None,
           endpoint_url: str | None = None) -> dict:
    """Write speculators' Arrow index of `output` (a directory or s3://) into `dest` and the file
    that points the `vx` backend at it; returns what the train command needs (`target_layer_ids`,
    rows, tokens)."""
    try:
        import datasets
    except ImportError:
        raise UsageError("vx export --to speculators writes a Hugging Face datasets index: "
                         "pip install 'vx[speculators]'") from None

    datasets.disable_progress_bars()
    remote = str(output).startswith("s3://")
    cat = Catalog(str(output) if remote else str(Path(output).resolve()), endpoint_url)
    meta = cat.meta
    layers = speculators_layers(meta.get("layer_ids", []), int(meta["num_layers"]), target)
    count = {"rows": 0, "tokens": 0, "refused": 0}

    def rows():  # streamed: memory stays bounded
        for s, rec, f in _shard_files(cat, endpoint_url):
            ok = f is not None
            if not ok:
                n = int(cat.start[s + 1] - cat.start[s])
                count["refused"] += n
                print(f"vx: {rec['shard']}: {checksum.which(rec)} does not match the manifest; its {n} samples are missing",
                      file=sys.stderr)
                f = _tokens_only(cat, s)
            t = {n: f.tensor(n) for n in ("input_ids", "loss_mask", "offsets", "hidden_states", "hidden_scales")
                 if n in f.entries}
            offsets = t["offsets"].tolist()
            for row in range(len(offsets) - 1):
                a, b = offsets[row], offsets[row + 1]
                count["rows"] += 1
                count["tokens"] += b - a
                item = {"vx_id": cat.id(int(cat.start[s]) + row), "vx_shard": rec["shard"], "vx_row": row,
                        "input_ids": t["input_ids"][a:b].tolist(), "loss_mask": t["loss_mask"][a:b].tolist(),
                        "seq_len": b - a}
                if remote:  # each row's own digest: the backend reads rows by ranged GETs and checks them
                    item["vx_offset"] = a
                    item["vx_sha256"] = row_digest({k: v[a:b] for k, v in t.items()}) if ok else ""
                yield item

    dest = Path(dest)
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as cache:
        index = datasets.Dataset.from_generator(rows, cache_dir=cache, fingerprint=uuid.uuid4().hex)
        index.set_format("torch")
        index.save_to_disk(str(dest))
    source = {"format": FORMAT, "output": cat.path, "endpoint_url": endpoint_url,
              "bytes": sum(r["bytes"] for r in cat.shards), "layer_ids": layers,
              "target_layer_ids": [k + 1 for k in layers[:-1]], "num_layers": int(meta["num_layers"]),
              "hidden_size": int(meta["hidden_size"]), "model": meta.get("model"),
              "store_dtype": meta.get("store_dtype"), "compress": meta.get("compress", "none")}
    (dest / SOURCE).write_text(json.dumps(source, indent=2) + "\n")
    return dict(source, **count)


def _shard_files(cat: Catalog, endpoint_url: str | None):
    """(index, record, ShardFile) of each shard, in order. A local shard is mapped in place (its
    checksum is checked when the backend first reads it); an S3 shard is downloaded whole, a few
    ahead, and checked: a file that fails comes back as None."""
    if not cat.remote:
        for s, rec in enumerate(cat.shards):
            yield s, rec, ShardFile(Path(cat.path) / rec["shard"])
        return
    from concurrent.futures import ThreadPoolExecutor

    from vx.store.s3_client import make_client, parse_s3_url

    client, where = make_client(endpoint_url), parse_s3_url(cat.path)

    def fetch(rec, tmp: Path) -> bool:
        client.download_file(where.bucket, where.key(rec["shard"]), str(tmp))
        return checksum.file_ok(tmp, rec)

    with tempfile.TemporaryDirectory(prefix="vx-export-") as d, ThreadPoolExecutor(2) as pool:
        files = [Path(d) / f"{s}-{Path(rec['shard']).name}" for s, rec in enumerate(cat.shards)]
        ahead = {s: pool.submit(fetch, cat.shards[s], files[s]) for s in range(min(2, len(files)))}
        for s, rec in enumerate(cat.shards):
            ok = ahead.pop(s).result()
            if s + 2 < len(files):
                ahead[s + 2] = pool.submit(fetch, cat.shards[s + 2], files[s + 2])
            yield s, rec, ShardFile(files[s]) if ok else None
            files[s].unlink()


def _tokens_only(cat: Catalog, s: int):
    """A stand-in for a refused shard: its manifest's lengths, no tokens (its rows are never read)."""
    lengths = cat.tokens[cat.start[s]:cat.start[s + 1]]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(lengths.astype("int64")).cumsum(0)
    t = {"offsets": offsets, "input_ids": torch.zeros(int(offsets[-1]), dtype=torch.int32),
         "loss_mask": torch.zeros(int(offsets[-1]), dtype=torch.uint8)}

    class Tokens:
        entries = t

        @staticmethod
        def tensor(name):
            return t[name]

    return Tokens
