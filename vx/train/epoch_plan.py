"""What the loader reads and in which order: the catalog of an output's samples and the epoch plan.

The catalog is columnar (per sample: shard, row, tokens and the id as UTF-8 bytes in one
buffer), ~20 B per sample plus its id, so a reader of a 900k-sample output holds tens of MB,
not a Python object per sample. The plan is made from the catalog alone, identically in every
process for the same (seed, epoch); see vx/train/loader.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vx.errors import UsageError
from vx.store.format import MANIFEST, RUN_META, output_dirs, read_manifest


class Catalog:
    """Every committed sample of an output (root and partitions), from its manifests."""

    def __init__(self, path: str, endpoint_url: str | None = None, records: list[dict] | None = None,
                 meta: dict | None = None, shard_base: int = 0):
        """From the output's manifests, or (follow) from `records` already read, whose first is
        shard `shard_base` of the reader's shard table."""
        self.path, self.endpoint_url = str(path), endpoint_url
        self.remote = self.path.startswith("s3://")
        if records is None:
            records = self._remote() if self.remote else self._local()
        else:
            self.meta = meta
        counts = np.array([len(r["sample_ids"]) for r in records], dtype=np.int64)
        self.start = np.zeros(len(records) + 1, dtype=np.int64)   # [S + 1] first sample of each shard
        self.start[1:] = np.cumsum(counts)
        n = int(self.start[-1])
        self.shard_of = np.repeat(np.arange(shard_base, shard_base + len(records), dtype=np.int32), counts)  # [N]
        self.row = (np.arange(n, dtype=np.int64) - np.repeat(self.start[:-1], counts)).astype(np.int32)
        self.tokens = np.zeros(n, dtype=np.int32)
        blobs = []
        for i, rec in enumerate(records):
            lengths = rec.get("sample_tokens")
            if lengths is None:  # outputs written before the manifest carried lengths
                lengths = self._lengths_from_shard(rec)
            self.tokens[self.start[i]:self.start[i + 1]] = lengths
            blobs += [s.encode() for s in rec["sample_ids"]]
        self._id_end = np.cumsum([len(b) for b in blobs], dtype=np.int64)
        self._ids = b"".join(blobs)
        # the shard table without the per-sample lists (those now live in the arrays above)
        self.shards = [{k: v for k, v in r.items() if k not in ("sample_ids", "sample_tokens")} for r in records]

    @property
    def num_samples(self) -> int:
        return len(self.tokens)

    def id(self, i: int) -> str:
        a = int(self._id_end[i - 1]) if i else 0
        return self._ids[a:int(self._id_end[i])].decode()

    def _local(self) -> list[dict]:
        root = Path(self.path)
        if not (root / RUN_META).exists():
            raise UsageError(f"{root} is not a vx output (no {RUN_META})")
        self.meta = json.loads((root / RUN_META).read_text())
        return [dict(r, shard=str(d.relative_to(root) / r["shard"])) for d in output_dirs(root) for r in read_manifest(d)]

    def _remote(self) -> list[dict]:
        from vx.store.s3_client import S3Target, make_client, parse_s3_url
        from vx.store.s3 import layout_names, remote_manifest

        target, client = parse_s3_url(self.path), make_client(self.endpoint_url)
        self.meta, records = None, []
        for key, name in sorted(layout_names(client, target), key=lambda kn: kn[1]):
            head, _, base = name.rpartition("/")
            if base == RUN_META and not head:
                self.meta = json.loads(client.get_object(Bucket=target.bucket, Key=key)["Body"].read())
            elif base == MANIFEST:
                where = S3Target(target.bucket, target.key(head)) if head else target
                records += [dict(r, shard=f"{head}/{r['shard']}" if head else r["shard"])
                            for r in remote_manifest(where, None, client)]
        if self.meta is None:
            raise UsageError(f"{self.path} is not a vx output (no {RUN_META})")
        return records

    def _lengths_from_shard(self, rec: dict) -> list[int]:
        if self.remote:
            raise UsageError(f"{rec['shard']}: its manifest record has no sample_tokens (written by an older vx); "
                             "read the output from a local copy, or re-extract")
        from vx.store.reader import ShardFile

        offsets = ShardFile(Path(self.path) / rec["shard"]).tensor("offsets")
        return (offsets[1:] - offsets[:-1]).tolist()


@dataclass
class Batch:
    samples: np.ndarray       # catalog indices, in order
    padding: bool = False     # a repeat that only evens out batch counts: its loss mask is zeroed


def plan_epoch(catalog: Catalog, tokens_per_batch: int, world_size: int, seed: int, epoch: int,
               shuffle: bool = True, shuffle_shards: int = 8) -> list[list[Batch]]:
    """Every rank's batches for one epoch: shards in a seeded order, samples shuffled within a
    window of `shuffle_shards` shards, packed in that order, evened out, dealt round robin."""
    rng = np.random.default_rng([seed, epoch])
    nshards = len(catalog.start) - 1
    order = rng.permutation(nshards) if shuffle else np.arange(nshards)
    parts = []
    for w in range(0, nshards, shuffle_shards):
        idx = np.concatenate([np.arange(catalog.start[s], catalog.start[s + 1]) for s in order[w:w + shuffle_shards]])
        parts.append(idx[rng.permutation(len(idx))] if shuffle else idx)
    seq = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    batches = even_out(pack(seq, catalog.tokens, tokens_per_batch), catalog.tokens, world_size)
    return [batches[r::world_size] for r in range(world_size)]


def plan_window(catalog: Catalog, tokens_per_batch: int, world_size: int, seed: int, epoch: int, window: int,
                shuffle: bool = True) -> list[list[Batch]]:
    """Every rank's batches from one window of a growing output (follow): its samples shuffled,
    packed, evened out and dealt as plan_epoch does over a whole epoch."""
    rng = np.random.default_rng([seed, epoch, window])
    seq = np.arange(catalog.num_samples)
    if shuffle:
        seq = seq[rng.permutation(len(seq))]
    batches = even_out(pack(seq, catalog.tokens, tokens_per_batch), catalog.tokens, world_size)
    return [batches[r::world_size] for r in range(world_size)]


def pack(seq: np.ndarray, tokens: np.ndarray, budget: int) -> list[Batch]:
    """In order, at most `budget` tokens per batch; a longer sample is a batch of its own."""
    cuts, acc = [0], 0
    for k, t in enumerate(tokens[seq].tolist()):
        if k > cuts[-1] and acc + t > budget:
            cuts.append(k)
            acc = 0
        acc += t
    cuts.append(len(seq))
    return [Batch(seq[a:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def even_out(batches: list[Batch], tokens: np.ndarray, world_size: int) -> list[Batch]:
    """Split multi-sample batches (the largest first) until the count divides world_size; when
    none can be split, the last batch is repeated as padding."""
    batches = list(batches)
    while batches and len(batches) % world_size:
        i = max(range(len(batches)), key=lambda k: (len(batches[k].samples), -k))
        b = batches[i].samples
        if len(b) < 2:
            break
        t = np.cumsum(tokens[b])
        half = int(np.clip(np.searchsorted(t, t[-1] / 2, side="right"), 1, len(b) - 1))
        batches[i:i + 1] = [Batch(b[:half]), Batch(b[half:])]
    while batches and len(batches) % world_size:
        batches.append(Batch(batches[-1].samples, padding=True))
    return batches
