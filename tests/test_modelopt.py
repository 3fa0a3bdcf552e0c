"""ModelOpt trains its offline DFlash drafter on a vx output in place, with its own code: its
OfflineSupervisedDataset gives items (and its collator batches) bit-equal to those from `.pt` files
in its own layout holding the same tensors; the layers are HF's `hidden_states[id + 1]` by its own
rule, and the last hidden state, through its own final-norm step, is HF's post-norm output; its
DFlash model (converted by mtsp.convert) trains a few steps on CPU from the output with a falling
loss; an output without the last layer is refused with one line. No file is written per sample."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd

import vx

pytestmark = pytest.mark.xdist_group("modelopt")

CHAT = ROOT / "examples" / "chat.jsonl"
OVERLAY = ROOT / ".venv" / "overlay-modelopt"  # ModelOpt's transformers (< 5.13), made by .ci/setup


@pytest.fixture(scope="module", autouse=True)
def installed():
    from vx.train import modelopt

    modelopt.install()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_model):
    """16 conversations of the embedded default: bf16 (layers 1-5 and the last, 7) in shards of 6, and
    fp8 coded in blocks (layers 1, 5, 7), both with the hf backend."""
    d = tmp_path_factory.mktemp("modelopt")
    data = write_jsonl(d / "d.jsonl", [json.loads(line) for line in open(CHAT)][:16])
    runs = {}
    for dtype, layers, extra in (("bf16", "1,2,3,4,5,7", ()), ("fp8", "1,5,7", ("--compress", "blocks"))):
        r = vx_cmd("extract", str(data), "-o", str(d / dtype), "--backend", "hf", "--layers", layers,
                   "--store-dtype", dtype, "--shard-size", "6", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[dtype] = d / dtype
    return runs


def native_files(out, dest, layers):
    """ModelOpt's own offline layout ({conversation_id}.pt, as its vLLM dumper writes it: pre-norm last
    hidden state), written from vx.open_dataset's tensors."""
    ds = vx.open_dataset(out)
    dest.mkdir()
    files = []
    for sid in ds.ids:
        item = ds[sid]
        h = item["hidden_states"]  # [T, L, H]
        files.append(str(dest / f"{sid}.pt"))
        torch.save({"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].long(),
                    "hidden_states": h[:, ds.layer_ids.index(7)].clone(),
                    "aux_hidden_states": h[:, [ds.layer_ids.index(k) for k in layers]].flatten(1).clone(),
                    "hidden_states_prenorm": True, "conversation_id": sid}, files[-1])
    return files


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_its_dataset_and_collator_give_what_its_own_files_give(outputs, tmp_path, dtype):
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    from vx.train import modelopt

    out, layers = outputs[dtype], [1, 5]
    modelopt.use_layers(layers)
    native = native_files(out, tmp_path / "native", layers)
    for answer_only_loss in (True, False):
        theirs = OfflineSupervisedDataset(native, answer_only_loss=answer_only_loss)
        ours = OfflineSupervisedDataset(modelopt.dumped_files(str(out)), answer_only_loss=answer_only_loss)
        assert len(ours) == len(theirs) == 16
        for i in range(16):
            a, b = theirs[i], ours[i]
            assert a.keys() == b.keys()
            for k in a:
                same = a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                assert same, (i, k)
        collate = EagleOfflineDataCollator(train_len=256)
        x, y = collate([theirs[i] for i in (0, 5, 11)]), collate([ours[i] for i in (0, 5, 11)])
        flat = lambda d: {k: v for k, v in d.items() if not isinstance(v, dict)} | d.get("base_model_outputs", {})  # noqa: E731
        for k, v in flat(x).items():
            assert torch.equal(v, flat(y)[k]) if torch.is_tensor(v) else v == flat(y)[k], k
    assert not list(out.rglob("*.pt")), "nothing is written per sample"


def test_layers_and_the_last_state_through_its_norm_are_hfs(outputs, fp32_model):
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_dflash import build_target_layer_ids
    from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm

    from vx.engine.reference import bound, compare
    from vx.train import modelopt

    layers = build_target_layer_ids(8, 2)  # its rule for a 2-layer draft of an 8-layer target
    modelopt.use_layers(layers)
    ds = OfflineSupervisedDataset(modelopt.dumped_files(str(outputs["bf16"])))
    limit = bound("qwen3_5", "float32", "bf16")
    for i in (0, 9):
        item = ds[i]
        n = item["input_ids"].shape[0]
        with torch.inference_mode():
            hs = fp32_model(item["input_ids"][None], output_hidden_states=True).hidden_states
            normed = _maybe_apply_base_final_norm(item["base_model_hidden_states"].float(),
                                                  {"base_hidden_prenorm": item["base_hidden_prenorm"]},
                                                  fp32_model.model.norm)
        want = torch.stack([hs[k + 1][0] for k in layers], 1)  # how its DFlash model picks them online
        got = item["aux_hidden_states"].view(n, len(layers), -1)
        assert all(limit.ok(c, r) for c, _, r in compare(got, want))
        assert not all(limit.ok(c, r) for c, _, r in compare(got, torch.stack([hs[k][0] for k in layers], 1)))
        assert all(limit.ok(c, r) for c, _, r in compare(normed[:, None], hs[-1][0][:, None]))  # HF's last is post-norm


def test_its_dflash_model_trains_a_few_steps_from_the_output(outputs, tiny_model):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OVERLAY), str(ROOT)]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "modelopt_steps.py"), str(tiny_model),
                        str(outputs["bf16"]), "6"], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["type"] == "OfflineSupervisedDataset" and got["batches"] == 8  # 16 samples, batches of 2
    assert got["layers"] == [1, 5] and "vx: ModelOpt's DFlash draft reads target layers [1, 5]" in r.stderr
    losses = got["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_an_output_without_the_last_layer_is_refused_with_one_line(tmp_path, tiny_model):
    from vx.errors import UsageError
    from vx.train import modelopt

    data = write_jsonl(tmp_path / "d.jsonl", [json.loads(line) for line in open(CHAT)][:2])
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf", "--layers", "1,5")
    assert r.returncode == 0, r.stderr[-2000:]
    with pytest.raises(UsageError, match=r"holds layers \[1, 5\], not 7: .* --layers speculators-dflash"):
        modelopt.dumped_files(str(tmp_path / "out"))
    r = subprocess.run([sys.executable, "-m", "vx.train.modelopt", "train.py"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().startswith("vx: usage: python -m vx.train.modelopt")


def test_eagle3_aux_layers_are_recorded_at_convert_and_are_hfs(outputs, tiny_model, fp32_model):
    """EAGLE-3 hooks its aux layers' outputs (vx ids) in forward order: the dataset hands them out
    ascending, each HF `hidden_states[id + 1]`. (Its forward on a hybrid GDN target fails inside
    ModelOpt 0.47's cache handling, so no training steps here.)"""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.hf_eagle import default_eagle_aux_layer_ids
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    from vx.engine.reference import bound, compare
    from vx.train import modelopt

    model = load_vlm_or_llm(str(tiny_model), use_offline_training=True, dtype=torch.float32, device_map="cpu")
    mtsp.convert(model, [("eagle", {"eagle_offline": True, "eagle_architecture_config": {"num_hidden_layers": 1}})])
    layers = sorted(default_eagle_aux_layer_ids(8))
    assert modelopt._state["layers"] == layers == sorted(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    item = OfflineSupervisedDataset(modelopt.dumped_files(str(outputs["bf16"])))[3]
    n = item["input_ids"].shape[0]
    with torch.inference_mode():
        hs = fp32_model(item["input_ids"][None], output_hidden_states=True).hidden_states
    limit = bound("qwen3_5", "float32", "bf16")
    got = item["aux_hidden_states"].view(n, len(layers), -1)
    assert all(limit.ok(c, r) for c, _, r in compare(got, torch.stack([hs[k + 1][0] for k in layers], 1)))
