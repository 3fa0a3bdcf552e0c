"""SpecForge trains on a vx output in place: its own reader, feature store, normalizer, collator,
loader and trainer, fed from vx's shards; no file is written per sample.

SpecForge (0.2) trains offline from one `.ckpt` file per sample (`input_ids` [T], `loss_mask` [T],
`hidden_states` [1, T, L*H], the target layers concatenated in its `target_layer_ids` order; its id
k is HF `hidden_states[k + 1]`, the same as vx's). Its reader lists the files with
`offline_reader.list_feature_files` and its feature store loads one with
`feature_store.load_feature_file`, both looked up when called. `install()` replaces those two in
the training process: a vx output (a directory or s3://) given as `data.hidden_states_path` lists
as one path per sample, `<output>#vx-row=<i>.ckpt`, and each loads as the record SpecForge's own
files hold, built from the shard's rows:
- the target layers are the ones SpecForge's DFlash draft model reads (`target_layer_ids`, recorded
  when SpecForge builds it); the states come in `model.torch_dtype`, fp8 outputs dequantized;
- only the first `data.max_length` tokens are read (SpecForge's normalizer keeps no more);
- a sample without two consecutive supervised tokens in them (which SpecForge's DFlash normalizer
  refuses, stopping the run) is left out when listing, from its loss mask alone, and counted;
- local shards are checked against their manifest's checksum the first time one is read; S3 shards
  are fetched whole into a bounded, checked cache (`--vx-cache-gb`: SpecForge shuffles over the whole
  dataset, so make it hold the output, or each shard is fetched again). A shard that fails its check
  stops the run with one line naming it (SpecForge has no policy for a missing sample).
Other paths load as before. `python -m vx.train.specforge train -c cfg.yaml [section.field=value ...]`
runs SpecForge's own command line with this installed; under `torchrun -m vx.train.specforge` each
rank does, and a run that launches its own ranks (`deployment.trainer.nproc_per_node > 1`) launches
them through this module too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from vx.errors import UsageError, VxError
from vx.store.reader import ShardHeader
from vx.train.rows import OutputRows, is_output, options_to_env

ROW = "#vx-row="
SUFFIX = ".ckpt"
ENV = {"cache_dir": "VX_SPECFORGE_CACHE_DIR", "cache_gb": "VX_SPECFORGE_CACHE_GB",
       "endpoint_url": "VX_SPECFORGE_ENDPOINT_URL"}  # options reach self-launched ranks through these

_state: dict = {"layers": None, "max_len": None, "dtype": torch.bfloat16, "outputs": {}, "original": {}}


class VxFeatures:
    """The samples of one vx output as SpecForge feature records (one reader per training process;
    SpecForge's loader threads call `load` concurrently)."""

    def __init__(self, output: str, max_len: int | None):
        self.output, self.max_len = output, max_len
        self.rows = OutputRows(output, os.environ.get(ENV["endpoint_url"]), os.environ.get(ENV["cache_dir"]),
                               float(os.environ.get(ENV["cache_gb"], "20")), tag="specforge")
        self.cat, self.stored = self.rows.cat, self.rows.stored
        self.left_out = 0

    def paths(self) -> list[str]:
        """One path per sample SpecForge can train on, in the output's order."""
        keep, self.left_out = [], 0
        for s, rec in enumerate(self.cat.shards):
            offsets, mask = self._masks(s, rec)
            for row in range(len(offsets) - 1):
                a, b = int(offsets[row]), int(offsets[row + 1])
                m = mask[a:b if self.max_len is None else min(b, a + self.max_len)]
                if (m[:-1] & m[1:]).any():
                    keep.append(f"{self.output}{ROW}{int(self.cat.start[s]) + row}{SUFFIX}")
                else:
                    self.left_out += 1
        if self.left_out and os.environ.get("RANK", "0") == "0":
            within = f" in their first {self.max_len} tokens" if self.max_len else ""
            print(f"vx: {self.left_out} of {self.cat.num_samples} samples have no two consecutive supervised "
                  f"tokens{within} (SpecForge's DFlash normalizer refuses them): left out", file=sys.stderr)
        return keep

    def _masks(self, s: int, rec: dict) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [n + 1], loss_mask [T] as bool) of shard s, without reading its states."""
        if not self.cat.remote:
            h = ShardHeader(Path(self.cat.path) / rec["shard"])
            try:
                offsets = h.offsets.numpy()
                return offsets, h.rows("loss_mask", 0, int(offsets[-1]), None).numpy().astype(bool)
            finally:
                h.close()
        if rec["shard"].endswith(".zst"):  # --compress zstd: no byte ranges; the whole shard, through the cache
            f, offsets = self.rows.shard(s)
            return np.asarray(offsets), f.tensor("loss_mask").numpy().astype(bool)
        from vx.store.remote_rows import RemoteRows

        if getattr(self, "_remote", None) is None:
            self._remote = RemoteRows(self.cat.path, self.cat.endpoint_url)
        got = self._remote.tensors(rec["shard"], ("offsets", "loss_mask"))
        if got is None:
            raise VxError(f"{self.cat.path}/{rec['shard']}: not the shard its manifest lists (unreadable header)")
        return got["offsets"].numpy(), got["loss_mask"].numpy().astype(bool)

    def load(self, index: int) -> dict[str, torch.Tensor]:
        layers = _state["layers"]
        if layers is None:
            raise VxError("SpecForge read a sample before it built its DFlash draft model: vx cannot tell which "
                          "target layers to hand out (only training.strategy=dflash is served)")
        ids, mask, states = self.rows.read(index, layers, self.max_len)  # [T], [T], [T, n, H]
        return {"input_ids": ids.long(), "loss_mask": mask.long(),
                "hidden_states": states.reshape(1, states.shape[0], -1).to(_state["dtype"])}  # [1, T, n*H]


# SpecForge's two functions, and what vx wraps around them ------------------------------------------
def list_feature_files(path: str) -> list[str]:
    if not is_output(path):
        return _state["original"]["list_feature_files"](path)
    outputs = _state["outputs"]
    if path not in outputs:
        outputs[path] = VxFeatures(str(path), _state["max_len"])
    return outputs[path].paths()


def load_feature_file(path: str) -> dict[str, torch.Tensor]:
    output, sep, rest = str(path).rpartition(ROW)
    if not sep:
        return _state["original"]["load_feature_file"](path)
    if output not in _state["outputs"]:
        _state["outputs"][output] = VxFeatures(output, _state["max_len"])
    return _state["outputs"][output].load(int(rest.removesuffix(SUFFIX)))


def use_layers(layers: list[int]) -> None:
    """The target layers (vx ids) a record's hidden_states holds, in order: what SpecForge's DFlash
    draft reads. The training command records them when SpecForge builds its draft; call this when
    you assemble SpecForge's loader yourself."""
    _state["layers"] = [int(k) for k in layers]


def _record_layers(build):
    def build_dflash_draft(cfg, draft_config, kernels):
        draft = build(cfg, draft_config, kernels)
        layers = [int(k) for k in draft.target_layer_ids]
        path = cfg.data.hidden_states_path
        if path and is_output(path):
            stored = _state["outputs"].get(path) or VxFeatures(path, _state["max_len"])
            missing = [k for k in layers if k not in stored.stored]
            if missing:
                raise UsageError(f"the DFlash draft reads target layers {layers}; {path} holds {stored.stored}: set "
                                 "dflash_config.target_layer_ids in the draft config (model.draft_model_config) to "
                                 "stored layers, or extract these with vx extract --layers")
        _state["layers"] = layers
        if path and is_output(path) and os.environ.get("RANK", "0") == "0":
            print(f"vx: SpecForge's DFlash draft reads target layers {layers} (vx ids: the outputs of those decoder "
                  f"layers) of {path}", file=sys.stderr)
        return draft
    return build_dflash_draft


def _remember_config(load):
    def load_config(path, overrides=None):
        cfg = load(path, overrides)
        if cfg.data.hidden_states_path and is_output(cfg.data.hidden_states_path) and cfg.training.strategy != "dflash":
            raise UsageError(f"vx serves SpecForge's DFlash training (training.strategy=dflash), not "
                             f"{cfg.training.strategy!r}")
        _state["max_len"] = cfg.data.max_length
        _state["dtype"] = getattr(torch, cfg.model.torch_dtype)
        return cfg
    return load_config


def _launch_through_vx(build):
    def build_launch_plan(cfg, **kw):  # ranks it launches run this module, so they read vx outputs too
        kw.setdefault("worker_prefix", (sys.executable, "-m", "vx.train.specforge"))
        kw.setdefault("torchrun_prefix", (sys.executable, "-m", "torch.distributed.run", "--no-python"))
        return build(cfg, **kw)
    return build_launch_plan


def install() -> None:
    """Make this process's SpecForge read vx outputs (idempotent)."""
    if _state["original"]:
        return
    try:
        import specforge.algorithms.model_providers as providers
        import specforge.cli as cli
        import specforge.launch_plan as launch_plan
        from specforge.runtime.data_plane import feature_store, offline_reader
    except ImportError as e:
        raise ImportError("vx's SpecForge route needs SpecForge: pip install --no-deps specforge==0.2.0 "
                          "(docs/specforge.md lists its light runtime dependencies)") from e
    _state["original"] = {"list_feature_files": offline_reader.list_feature_files,
                          "load_feature_file": feature_store.load_feature_file}
    offline_reader.list_feature_files = list_feature_files
    offline_reader.load_feature_file = feature_store.load_feature_file = load_feature_file
    providers.build_dflash_draft = _record_layers(providers.build_dflash_draft)
    cli.load_config = _remember_config(cli.load_config)
    launch_plan.build_launch_plan = _launch_through_vx(launch_plan.build_launch_plan)


def main(argv: list[str] | None = None) -> int:
    """`python -m vx.train.specforge train -c cfg.yaml [--vx-cache-gb G] [--vx-cache-dir D]
    [--vx-endpoint-url U] [section.field=value ...]`: SpecForge's command line, reading vx outputs."""
    try:
        args = options_to_env(sys.argv[1:] if argv is None else argv, ENV)
    except UsageError as e:
        print(f"vx: {e}", file=sys.stderr)
        return e.exit_code
    install()
    from specforge.cli import main as specforge_main

    try:
        return specforge_main(args)
    except VxError as e:
        print(f"vx: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":  # the importable module's state, which its replacements read
    from vx.train.specforge import main as _main

    raise SystemExit(_main())
