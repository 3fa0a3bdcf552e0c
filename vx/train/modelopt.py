"""ModelOpt trains its DFlash (or EAGLE-3) drafter offline on a vx output in place: its own
dataset, collator, model and trainer, fed from vx's shards; no file is written per sample.

ModelOpt (0.47) trains offline from one `{conversation_id}.pt` per sample, read by
`OfflineSupervisedDataset` (modelopt/torch/speculative/eagle/utils.py) with `torch.load`:
`input_ids` [T], `hidden_states` [T, H] (the target's last hidden state), `aux_hidden_states`
[T, n*H] (the draft's target layers concatenated; its id k is HF `hidden_states[k + 1]`, the same
as vx's), `loss_mask` [T] and `hidden_states_prenorm` (True: ModelOpt applies the target's final
norm itself). `install()` makes that module's `torch.load` resolve `<output>#vx-row=<i>.pt` to that
record, read from the shards (vx/train/rows.py); any other path loads as before, and ModelOpt's
dataset class runs unchanged. vx gives:
- `hidden_states`: vx layer N-1, the output of the last decoder layer before the final norm, with
  `hidden_states_prenorm=True` (ModelOpt re-applies the final norm where it needs logits);
- `aux_hidden_states`: the layers ModelOpt's draft reads (DFlash's `target_layer_ids`, EAGLE-3's
  aux layer ids ascending; recorded when `mtsp.convert` builds it, or given to `use_layers`); fp8
  outputs dequantized.

`python -m vx.train.modelopt MAIN.py --config RECIPE.yaml [overrides]` runs ModelOpt's example
trainer (examples/speculative_decoding/main.py of a Model-Optimizer checkout) with this installed:
its offline data module (`data.offline_data_path`) then takes a vx output, local or s3://.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

from vx.errors import UsageError, VxError
from vx.train.rows import OutputRows, is_output, options_to_env

ROW = "#vx-row="
SUFFIX = ".pt"
ENV = {"cache_dir": "VX_MODELOPT_CACHE_DIR", "cache_gb": "VX_MODELOPT_CACHE_GB",
       "endpoint_url": "VX_MODELOPT_ENDPOINT_URL"}

_state: dict = {"layers": None, "outputs": {}, "installed": False}


def rows(output: str) -> OutputRows:
    if output not in _state["outputs"]:
        r = OutputRows(output, os.environ.get(ENV["endpoint_url"]), os.environ.get(ENV["cache_dir"]),
                       float(os.environ.get(ENV["cache_gb"], "20")), tag="modelopt")
        if r.num_layers - 1 not in r.stored:
            raise UsageError(f"{output} holds layers {r.stored}, not {r.num_layers - 1}: the target's last hidden state "
                             "ModelOpt's offline data carries; extract with --layers speculators-dflash (or add it)")
        _state["outputs"][output] = r
    return _state["outputs"][output]


def dumped_files(output: str) -> list[str]:
    """One path per sample of `output`, in its order: what ModelOpt's dataset takes as its files."""
    return [f"{output}{ROW}{i}{SUFFIX}" for i in range(len(rows(output)))]


def use_layers(layers: list[int]) -> None:
    """The draft's target layers (vx ids), in its order: `aux_hidden_states` holds them."""
    _state["layers"] = [int(k) for k in layers]


def load(path: str) -> dict:
    """The record ModelOpt's own .pt file holds, for a vx path."""
    output, _, rest = str(path).rpartition(ROW)
    layers = _state["layers"]
    if layers is None:
        raise VxError("ModelOpt read a sample before its DFlash draft was built: vx cannot tell which target layers "
                      "aux_hidden_states holds (convert the model with mtsp.convert first, or call use_layers)")
    r = rows(output)
    last = r.num_layers - 1
    index = int(rest.removesuffix(SUFFIX))
    ids, mask, states = r.read(index, [*layers, last])  # [T], [T], [T, n + 1, H]
    return {"input_ids": ids.long(), "loss_mask": mask.long(),
            "hidden_states": states[:, -1].contiguous(),                                 # [T, H]
            "aux_hidden_states": states[:, :-1].reshape(states.shape[0], -1),            # [T, n*H]
            "hidden_states_prenorm": True, "conversation_id": r.cat.id(index)}


class _TorchLoadingVx:
    """`torch` as ModelOpt's offline dataset module sees it: the same, but `load` reads vx paths."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, **kwargs):
        if isinstance(f, str) and ROW in f:
            return load(f)
        return torch.load(f, *args, **kwargs)


def _record_layers(convert):
    def convert_recording_layers(model, mode, *args, **kwargs):
        out = convert(model, mode, *args, **kwargs)
        kind, layers = "DFlash", getattr(model, "target_layer_ids", None)
        eagle = getattr(model, "eagle_config", None)
        if layers is None and eagle is not None and getattr(eagle, "use_aux_hidden_state", False):
            # EAGLE-3 hooks its layers' outputs in forward order, so its aux states come ascending
            kind, layers = "EAGLE-3", sorted(eagle.eagle_aux_hidden_state_layer_ids)
        if layers is not None:
            use_layers(layers)
            if os.environ.get("RANK", "0") == "0":
                print(f"vx: ModelOpt's {kind} draft reads target layers {list(layers)}", file=sys.stderr)
        return out
    return convert_recording_layers


def install() -> None:
    """Make this process's ModelOpt offline dataset read vx outputs (idempotent)."""
    if _state["installed"]:
        return
    try:
        import modelopt.torch.speculative as mtsp
        from modelopt.torch.speculative.eagle import utils
    except ImportError as e:
        raise ImportError("vx's ModelOpt route needs ModelOpt: pip install --no-deps nvidia-modelopt==0.47.0 "
                          "(docs/modelopt.md lists its light runtime dependencies)") from e
    utils.torch = _TorchLoadingVx()
    mtsp.convert = _record_layers(mtsp.convert)
    _state["installed"] = True


def _offline_module(make):
    """The example's data module: a vx output as `data.offline_data_path` becomes ModelOpt's own
    offline dataset and collator over vx paths; anything else goes to the example's code."""
    def make_speculative_data_module(tokenizer, data_args, train_len=None, answer_only_loss=False, **kw):
        path = getattr(data_args, "offline_data_path", None)
        if getattr(data_args, "mode", "online") in ("online", "streaming") or not path or not is_output(path):
            return make(tokenizer, data_args, train_len=train_len, answer_only_loss=answer_only_loss, **kw)
        from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

        files = dumped_files(str(path))
        size = getattr(data_args, "sample_size", -1)
        if size and size > 0:
            files = files[:size]
        return {"train_dataset": OfflineSupervisedDataset(files, answer_only_loss=answer_only_loss, tokenizer=tokenizer),
                "data_collator": EagleOfflineDataCollator(train_len=train_len)}
    return make_speculative_data_module


def main(argv: list[str] | None = None) -> int:
    """`python -m vx.train.modelopt MAIN.py --config RECIPE.yaml [--vx-cache-gb G] [--vx-cache-dir D]
    [--vx-endpoint-url U] [overrides]`: ModelOpt's example trainer, reading vx outputs."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].endswith(".py") or not Path(args[0]).is_file():
        print("vx: usage: python -m vx.train.modelopt PATH/TO/Model-Optimizer/examples/speculative_decoding/main.py "
              "--config RECIPE.yaml [section.field=value ...]", file=sys.stderr)
        return 2
    try:
        args = options_to_env(args, ENV)
    except UsageError as e:
        print(f"vx: {e}", file=sys.stderr)
        return e.exit_code
    script = Path(args[0]).resolve()
    sys.path.insert(0, str(script.parent))  # the example's own modules (eagle_utils, scripts/)
    install()
    import eagle_utils  # the example's module, patched before its main imports from it

    eagle_utils.make_speculative_data_module = _offline_module(eagle_utils.make_speculative_data_module)
    sys.argv = [str(script), *args[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except VxError as e:
        print(f"vx: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":  # the importable module's state, which the replacements read
    from vx.train.modelopt import main as _main

    raise SystemExit(_main())
