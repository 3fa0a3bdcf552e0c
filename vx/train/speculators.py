"""speculators trains on a vx output in place: no copy of the states.

speculators (vLLM's drafter-training project) reads offline data as an Arrow index (`input_ids`,
`loss_mask`, `seq_len` per row: what its `ArrowDataset` loads) and a hidden-states backend that
returns, per row, {"hidden_states": [T, n, H], "token_ids": [T]}. The last of the n layers is the
verifier's last hidden state: the output of its last decoder layer, before the final norm (the
drafter applies `verifier_norm` itself); the others are the drafter's target layers, in order.
speculators counts the embedding as layer 0 (its id j is HF `hidden_states[j]`), so vx's id k
(the output of decoder layer k) is speculators' id k + 1.

- `export(output, dest)` (`vx export OUT --to speculators -o DEST`): the Arrow index (plus a
  `vx_id` column) and `vx-source.json`, which says where the output is and which vx layers the
  backend hands out, in speculators' order.
- the `vx` backend (`--hidden-states-backend vx`): rows read from the output through vx's reader
  (a zero-copy mmap); fp8 comes back dequantized as vx's reader does it. Each shard's sha256 is
  checked against its manifest the first time a row of it is read; the rows of a shard that
  fails are missing, which speculators handles by its `--on-missing` policy (skip, warn, raise).
- `python -m vx.train.speculators train ...` (also `vx-speculators`): speculators' own command
  line with the backend registered before speculators builds `--hidden-states-backend`'s choices.
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path

import torch

from vx.errors import UsageError, VxError
from vx.store.format import sha256_file
from vx.store.reader import open_dataset

try:
    from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("vx's speculators backend needs speculators: pip install 'vx[speculators]'") from e

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


def export(output: str | Path, dest: str | Path, target: list[int] | None = None) -> dict:
    """Write speculators' Arrow index of `output` into `dest` and the file that points the `vx`
    backend at it; returns what the train command needs (`target_layer_ids`, rows, tokens)."""
    import datasets

    if str(output).startswith("s3://"):
        raise UsageError(f"vx export reads a local output; copy {output} to a local directory first")
    datasets.disable_progress_bars()
    ds = open_dataset(output)
    meta = ds.meta
    layers = speculators_layers(ds.layer_ids, int(meta["num_layers"]), target)
    count = {"rows": 0, "tokens": 0}

    def rows():  # ids and masks only (the states are never read), streamed: memory stays bounded
        for rec in ds.shards:
            for sid in rec["sample_ids"]:
                ids, mask = ds.tokens(sid)
                count["rows"] += 1
                count["tokens"] += len(ids)
                yield {"vx_id": sid, "input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": len(ids)}

    dest = Path(dest)
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as cache:
        index = datasets.Dataset.from_generator(rows, cache_dir=cache, fingerprint=uuid.uuid4().hex)
        index.set_format("torch")
        index.save_to_disk(str(dest))
    source = {"format": FORMAT, "output": str(Path(output).resolve()), "layer_ids": layers,
              "target_layer_ids": [k + 1 for k in layers[:-1]], "num_layers": int(meta["num_layers"]),
              "hidden_size": int(meta["hidden_size"]), "model": meta.get("model"),
              "store_dtype": meta.get("store_dtype")}
    (dest / SOURCE).write_text(json.dumps(source, indent=2) + "\n")
    return dict(source, **count)


class VxTransfer(HiddenStatesTransfer):
    """Rows of a speculators Arrow index exported by vx, read from the vx output it points at."""

    def __init__(self, data_path: str | Path):
        self.data_path = Path(data_path)
        source_file = self.data_path / SOURCE
        if not source_file.exists():
            raise UsageError(f"{self.data_path} has no {SOURCE}: make it with `vx export OUT --to speculators "
                             f"-o {self.data_path}`")
        self.source = json.loads(source_file.read_text())
        self._ds = None
        self._ids: list[str] = []
        self._shard_ok: dict[int, bool] = {}

    def setup(self) -> None:
        self._open()

    def _open(self) -> None:
        if self._ds is not None:
            return
        from datasets import load_from_disk

        ds = open_dataset(self.source["output"])
        self._pos = [ds.layer_ids.index(k) for k in self.source["layer_ids"]]
        if self._pos == list(range(len(ds.layer_ids))):  # every stored layer, in order: the mmap view itself
            self._pos = slice(None)
        self._ids = load_from_disk(str(self.data_path)).with_format(None)["vx_id"]
        self._ds = ds

    def _checked(self, s: int) -> bool:
        """Whether shard s matches its manifest's sha256 (hashed once, on first use)."""
        if s not in self._shard_ok:
            rec = self._ds.shards[s]
            self._shard_ok[s] = sha256_file(self._ds.path / rec["shard"]) == rec["sha256"]
            if not self._shard_ok[s]:
                print(f"vx: {rec['shard']}: sha256 does not match the manifest; its "
                      f"{len(rec['sample_ids'])} samples are missing", file=sys.stderr)
        return self._shard_ok[s]

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self._open()
        sid = self._ids[file_idx]
        if not self._checked(self._ds.shard_of(sid)):
            return None
        item = self._ds[sid]
        return {"hidden_states": item["hidden_states"][:, self._pos],  # [T, n, H], the verifier's last at -1
                "token_ids": item["input_ids"].long()}                 # [T]

    def get_generated(self, hs_transfer_params: dict) -> dict[str, torch.Tensor] | None:
        raise VxError("a vx output generates no hidden states on demand: use --on-missing skip, warn or raise")

    def __getstate__(self):  # DataLoader workers reopen the output lazily
        state = self.__dict__.copy()
        state["_ds"] = None
        return state


class VxBackend(HiddenStatesBackend):
    """`--hidden-states-backend vx`: rows from the vx output that `vx export` pointed --data-path at."""

    @staticmethod
    def add_train_args(parser) -> None:
        pass  # everything comes from --data-path's vx-source.json

    @staticmethod
    def add_launch_args(parser) -> None:
        pass

    @staticmethod
    def from_train_args(args, data_path: str) -> VxTransfer:
        return VxTransfer(data_path)

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
