"""speculators trains on a vx output in place: no copy of the states.

speculators (vLLM's drafter-training project) reads offline data as an Arrow index (`input_ids`,
`loss_mask`, `seq_len` per row: what its `ArrowDataset` loads) and a hidden-states backend that
returns, per row, {"hidden_states": [T, n, H], "token_ids": [T]}. The last of the n layers is the
verifier's last hidden state: the output of its last decoder layer, before the final norm (the
drafter applies `verifier_norm` itself); the others are the drafter's target layers, in order.
speculators counts the embedding as layer 0 (its id j is HF `hidden_states[j]`), so vx's id k
(the output of decoder layer k) is speculators' id k + 1.

- `export(output, dest)` (`vx export OUT --to speculators -o DEST`, vx/train/speculators_index.py):
  the Arrow index and `vx-source.json`, which says where the output is and which vx layers the
  backend hands out, in speculators' order.
- the `vx` backend (`--hidden-states-backend vx`). A local output: rows are zero-copy views of
  the mapped shards, each shard's checksum checked against its manifest the first time a row of it
  is read. An S3 output (`--vx-s3-read`): `shards` fetches whole shards into the bounded,
  checksummed cache vx.loader uses (`--vx-cache-gb` per rank, split among its DataLoader
  workers; each shard is fetched once when the cache holds the output), `rows` reads each row by
  ranged GETs of its bytes alone and checks them against the digest the export made (no disk;
  speculators shuffles over the whole dataset, so a cache smaller than the output would fetch a
  whole shard for most rows); `auto` picks `shards` when the cache holds the output. fp8 comes
  back dequantized as vx's reader does it. Rows that fail a check are missing, which speculators
  handles by its `--on-missing` policy (skip, warn, raise).
- `python -m vx.train.speculators train ...` (also `vx-speculators`): speculators' own command
  line with the backend registered before speculators builds `--hidden-states-backend`'s choices.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from vx.errors import UsageError, VxError
from vx.store.encoding import decode
from vx.store import checksum
from vx.store.reader import open_dataset
from vx.store.remote_rows import RemoteRows
from vx.train.epoch_plan import Catalog
from vx.train.speculators_index import SOURCE, export, speculators_layers  # noqa: F401  (the module's API)

try:
    from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("vx's speculators backend needs speculators: pip install 'vx[speculators]'") from e



class VxTransfer(HiddenStatesTransfer):
    """Rows of a speculators Arrow index exported by vx, read from the vx output it points at:
    mapped in place from a directory; from S3 through the bounded, checksummed shard cache
    vx.loader uses (one per reader: a rank's DataLoader worker gets cache_gb / workers)."""

    def __init__(self, data_path: str | Path, cache_dir: str | None = None, cache_gb: float = 20.0,
                 endpoint_url: str | None = None, s3_read: str = "auto"):
        self.data_path = Path(data_path)
        source_file = self.data_path / SOURCE
        if not source_file.exists():
            raise UsageError(f"{self.data_path} has no {SOURCE}: make it with `vx export OUT --to speculators "
                             f"-o {self.data_path}`")
        if cache_gb <= 0:
            raise UsageError(f"--vx-cache-gb must be > 0, got {cache_gb}")
        self.source = json.loads(source_file.read_text())
        self.remote = self.source["output"].startswith("s3://")
        self.cache_dir, self.cache_gb = cache_dir, cache_gb
        if s3_read not in ("auto", "shards", "rows"):
            raise UsageError(f"--vx-s3-read must be auto, shards or rows, got {s3_read!r}")
        packed = self.source.get("compress", "none") == "zstd"  # a shard compressed whole has no byte range per row
        if s3_read == "rows" and packed:
            raise UsageError("--vx-s3-read rows needs shards with row byte ranges; this output's are zstd "
                             "files: use shards")
        if s3_read == "auto":  # whole shards when the cache holds the output: each is then fetched once
            s3_read = "shards" if packed or cache_gb * 1e9 >= self.source.get("bytes", float("inf")) else "rows"
        self.s3_read = s3_read
        self.endpoint_url = endpoint_url or self.source.get("endpoint_url")
        self._ds = self._cat = self._shards = self._rows = None
        self._shard_ok: dict[int, bool] = {}

    def setup(self) -> None:
        self._open()

    def _open(self) -> None:
        if self._ds is not None or self._cat is not None:
            return
        from datasets import load_from_disk

        index = load_from_disk(str(self.data_path)).with_format(None)
        if not self.remote:
            ds = open_dataset(self.source["output"])
            self._pos = self._positions(ds.layer_ids)
            self._ids = index["vx_id"]
            self._ds = ds
            return
        cat = Catalog(self.source["output"], self.endpoint_url)
        self._pos = self._positions(cat.meta["layer_ids"])
        names = {rec["shard"]: s for s, rec in enumerate(cat.shards)}
        self._at = [(names.get(shard, -1), row) for shard, row in zip(index["vx_shard"], index["vx_row"])]
        self._ids = index["vx_id"]
        if self.s3_read == "rows":
            self._span = list(zip(index["vx_offset"], index["seq_len"], index["vx_sha256"]))
        self._cat = cat

    def _positions(self, stored: list[int]):
        pos = [stored.index(k) for k in self.source["layer_ids"]]
        return slice(None) if pos == list(range(len(stored))) else pos  # every layer, in order: no copy

    def _cache(self):
        """This reader's shard cache (made in the process that reads: a DataLoader worker has its own)."""
        if self._shards is None:
            import hashlib
            import os

            from torch.utils.data import get_worker_info

            from vx.train.shard_cache import S3Shards

            info = get_worker_info()
            workers, wid = (info.num_workers, info.id) if info else (1, 0)
            base = Path(self.cache_dir) if self.cache_dir else Path(tempfile.gettempdir()) / "vx-loader-cache"
            key = hashlib.sha256(self._cat.path.encode()).hexdigest()[:12]
            tag = f"speculators-r{os.environ.get('RANK', '0')}-w{wid}"
            self._shards = S3Shards(self._cat.path, self.endpoint_url, self._cat.shards, base / key / tag,
                                    int(self.cache_gb * 1e9 / workers), plan=[], prefetch=1, concurrency=8)
        return self._shards

    def _refuse(self, s: int, why: str) -> None:
        if s not in self._shard_ok:
            self._shard_ok[s] = False
            print(f"vx: {why}; its samples are missing", file=sys.stderr)

    def _checked(self, s: int) -> bool:
        """Whether shard s matches its manifest's checksum (checked once, on first use)."""
        if s not in self._shard_ok:
            rec = self._ds.shards[s]
            if not checksum.file_ok(self._ds.path / rec["shard"], rec):
                self._refuse(s, f"{rec['shard']}: {checksum.which(rec)} does not match the manifest")
            self._shard_ok.setdefault(s, True)
        return self._shard_ok[s]

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self._open()
        if self.remote:
            return self._remote_row(file_idx)
        sid = self._ids[file_idx]
        if not self._checked(self._ds.shard_of(sid)):
            return None
        item = self._ds[sid]
        return {"hidden_states": item["hidden_states"][:, self._pos],  # [T, n, H], the verifier's last at -1
                "token_ids": item["input_ids"].long()}                 # [T]

    def _remote_row(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        from vx.train.shard_cache import ShardCorrupt

        s, row = self._at[file_idx]
        cat = self._cat
        if s < 0 or cat.id(int(cat.start[s]) + row) != self._ids[file_idx]:
            raise VxError(f"{self.data_path} does not index {cat.path} as it is now: export it again")
        if self.s3_read == "rows":
            if self._rows is None:
                self._rows = RemoteRows(cat.path, self.endpoint_url)
            a, n, digest = self._span[file_idx]
            got = self._rows.get(cat.shards[s]["shard"], a, a + n, digest) if digest else None
            if got is None:
                print(f"vx: {cat.shards[s]['shard']} row {row}: " + ("its bytes do not match the digest made when it "
                      "was indexed" if digest else "its shard failed its checksum when indexed") + "; the sample is "
                      "missing", file=sys.stderr)
                return None
            return {"hidden_states": got["hidden_states"][:, self._pos], "token_ids": got["input_ids"].long()}
        try:
            h = self._cache().get(s)
        except ShardCorrupt as e:
            self._refuse(s, str(e))
            return None
        a, b = int(h.offsets[row]), int(h.offsets[row + 1])
        scales = h.rows("hidden_scales", a, b, None) if "hidden_scales" in h.entries else None
        hidden = decode(h.rows("hidden_states", a, b, None), scales)
        return {"hidden_states": hidden[:, self._pos], "token_ids": h.rows("input_ids", a, b, None).long()}

    def get_generated(self, hs_transfer_params: dict) -> dict[str, torch.Tensor] | None:
        raise VxError("a vx output generates no hidden states on demand: use --on-missing skip, warn or raise")

    def close(self) -> None:
        if self._shards is not None:
            self._shards.close()
            self._shards = None

    def __getstate__(self):  # DataLoader workers reopen the output (and their own cache) lazily
        state = self.__dict__.copy()
        state["_ds"] = state["_cat"] = state["_shards"] = state["_rows"] = None
        return state


class VxBackend(HiddenStatesBackend):
    """`--hidden-states-backend vx`: rows from the vx output that `vx export` pointed --data-path at."""

    @staticmethod
    def add_train_args(parser) -> None:  # the output itself comes from --data-path's vx-source.json
        parser.add_argument("--vx-cache-dir", default=None,
                            help="vx backend, S3 outputs: where shards are cached (default: the temp dir)")
        parser.add_argument("--vx-cache-gb", type=float, default=20.0,
                            help="vx backend, S3 outputs: cache bound per rank, shared by its DataLoader workers")
        parser.add_argument("--vx-s3-read", default="auto", choices=["auto", "shards", "rows"],
                            help="vx backend, S3 outputs: whole shards through the cache, or each row by ranged "
                                 "GETs (auto: shards when --vx-cache-gb holds the output)")
        parser.add_argument("--vx-endpoint-url", default=None,
                            help="vx backend: S3-compatible endpoint (default: the one given to vx export)")

    @staticmethod
    def add_launch_args(parser) -> None:
        pass

    @staticmethod
    def from_train_args(args, data_path: str) -> VxTransfer:
        return VxTransfer(data_path, getattr(args, "vx_cache_dir", None), getattr(args, "vx_cache_gb", 20.0),
                          getattr(args, "vx_endpoint_url", None), getattr(args, "vx_s3_read", "auto"))

    @staticmethod
    def build_kv_transfer_config(args) -> dict:
        raise UsageError("the vx backend reads an extracted output; it launches no vLLM server")


if __name__ != "__main__":  # run as a script, the module imports itself below and registers once
    HiddenStatesBackend.register("vx")(VxBackend)


def main(argv: list[str] | None = None) -> None:
    """speculators' command line, with the vx backend registered (`python -m vx.train.speculators
    train --data-path DEST --hidden-states-backend vx ...`)."""
    from speculators.cli import app

    app(args=sys.argv[1:] if argv is None else argv, prog_name="vx-speculators")


if __name__ == "__main__":
    from vx.train.speculators import (
        main as _main,  # the importable module, whose classes workers unpickle
    )

    _main()
