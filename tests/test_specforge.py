"""SpecForge trains its DFlash drafter on a vx output in place, with its own code: its reader,
feature store, normalizer, collator and loader give batches bit-equal to those from files in its
own layout holding the same tensors; the layers it gets are HF's `hidden_states[id + 1]` by its own
rule; samples its normalizer would refuse are left out from their loss masks alone; its trainer
(DDP on CPU) trains from a local output and, with two ranks it launches itself, from an S3 one
(moto over HTTP); a corrupt shard and a wrong setting stop the run with one line. No file is
written per sample."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd

import vx

pytestmark = pytest.mark.xdist_group("specforge")

CHAT = ROOT / "examples" / "chat.jsonl"
ALTERNATING = [0, 1] * 20                   # no two supervised tokens in a row anywhere
LATE = [0] * 30 + [1, 1] + [0] * 8          # two in a row, but only after token 30


@pytest.fixture(scope="module", autouse=True)
def installed():
    """vx's two functions in place of SpecForge's, in this process, as the training command installs them."""
    from vx.train import specforge

    specforge.install()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_model):
    """22 conversations of the embedded default and two pre-tokenized rows (masks above), extracted
    with the hf backend: bf16 in shards of 8 (layers 1-5), and fp8 coded in blocks (layers 2-4)."""
    d = tmp_path_factory.mktemp("specforge")
    rows = [json.loads(line) for line in open(CHAT)][:22]
    rows += [{"id": "alternating", "input_ids": list(range(100, 140)), "loss_mask": ALTERNATING},
             {"id": "late", "input_ids": list(range(200, 240)), "loss_mask": LATE}]
    data = write_jsonl(d / "d.jsonl", rows)
    runs = {}
    for dtype, layers, extra in (("bf16", "1,2,3,4,5", ()), ("fp8", "2,3,4", ("--compress", "blocks"))):
        out = d / dtype
        r = vx_cmd("extract", str(data), "-o", str(out), "--backend", "hf", "--layers", layers,
                   "--store-dtype", dtype, "--shard-size", "8", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[dtype] = out
    return runs


def features(out, max_len):
    from vx.train import specforge

    return specforge.VxFeatures(str(out), max_len)


def native_files(out, dest: Path, layers: list[int], keep: set[str]):
    """SpecForge's own offline layout (rows_<a>-<b>/data_<i>.ckpt, torch.save dicts) of the kept samples,
    written from vx.open_dataset's tensors; names sort in the output's order, as its reader sorts them."""
    ds = vx.open_dataset(out)
    d = dest / f"rows_0-{len(ds)}"
    d.mkdir(parents=True)
    for i, sid in enumerate(ds.ids):
        if sid in keep:
            item = ds[sid]
            h = item["hidden_states"][:, [ds.layer_ids.index(k) for k in layers]]  # [T, n, H]
            torch.save({"input_ids": item["input_ids"].long(), "loss_mask": item["loss_mask"].long(),
                        "hidden_states": h.reshape(1, h.shape[0], -1).to(torch.bfloat16)}, d / f"data_{i:05d}.ckpt")
    return dest


def specforge_batches(path, max_len: int, batch_size: int = 3):
    """Every batch SpecForge's own DFlash offline pipeline makes of `path`, in order."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.launch import _offline_io
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    algorithm = builtin_algorithm_registry().resolve("dflash")
    refs = algorithm.providers.offline_for("text").build_reader(str(path), run_id="t", ttt_length=7,
                                                                 max_len=max_len).read()
    collate, normalize = _offline_io(algorithm, "text", max_len, ttt_length=7, use_usp_preprocess=False)
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=batch_size, collate_fn=collate,
                               per_sample_transform=normalize, drop_last=False, strategy="dflash", num_workers=2)
    return [b.tensors for b in loader]  # TrainBatch: its collated, padded tensors


@pytest.mark.parametrize("dtype,layers", [("bf16", [1, 5]), ("fp8", [2, 4])])
def test_specforge_batches_from_a_vx_output_equal_those_from_its_own_files(outputs, tmp_path, dtype, layers):
    from specforge.data.loss_mask import has_consecutive_supervised_tokens

    from vx.train import specforge

    out = outputs[dtype]
    ds = vx.open_dataset(out)
    keep = {sid for sid in ds.ids if has_consecutive_supervised_tokens(ds.tokens(sid)[1][:512])}
    assert len(keep) == len(ds) - 1  # the alternating row alone
    native = native_files(out, tmp_path / "native", layers, keep)
    specforge.use_layers(layers)
    theirs, ours = specforge_batches(native, 512), specforge_batches(out, 512)
    assert len(ours) == len(theirs) == -(-len(keep) // 3)
    for a, b in zip(theirs, ours):
        assert a.keys() == b.keys() == {"input_ids", "loss_mask", "hidden_states"}
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert not list(out.rglob("*.ckpt")), "nothing is written per sample"


def test_the_layers_are_hf_hidden_states_by_specforges_own_rule(outputs, fp32_model):
    from specforge.modeling.draft.dflash import extract_context_feature
    from specforge.runtime.data_plane.feature_store import load_feature_file

    from vx.engine.reference import bound, compare
    from vx.train import specforge

    out, layers = outputs["bf16"], [1, 5]
    specforge.use_layers(layers)
    paths = features(out, 512).paths()
    limit = bound("qwen3_5", "float32", "bf16")
    for path in paths[:3]:
        got = load_feature_file(path)
        n = got["input_ids"].shape[0]
        with torch.inference_mode():
            hs = fp32_model(got["input_ids"][None], output_hidden_states=True).hidden_states
        want = extract_context_feature(hs, layers)  # [1, T, 2H]: their rule, HF hidden_states[id + 1]
        for cos, _, rel in compare(got["hidden_states"].view(n, 2, -1), want.view(n, 2, -1)):
            assert limit.ok(cos, rel), (path, cos, rel)
        off_by_one = extract_context_feature(hs, [k - 1 for k in layers]).view(n, 2, -1)
        assert not all(limit.ok(c, r) for c, _, r in compare(got["hidden_states"].view(n, 2, -1), off_by_one))


def test_samples_its_normalizer_refuses_are_left_out_from_their_masks(outputs, capsys):
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.runtime.data_plane.feature_store import load_feature_file

    from vx.train import specforge

    out = outputs["bf16"]
    ds = vx.open_dataset(out)
    specforge.use_layers([1, 5])
    for max_len in (512, 32, 31, 16):
        refused = {sid for sid in ds.ids if not has_consecutive_supervised_tokens(ds.tokens(sid)[1][:max_len])}
        paths = features(out, max_len).paths()
        listed = {ds.ids[int(p.rpartition("#vx-row=")[2].removesuffix(".ckpt"))] for p in paths}
        assert listed == set(ds.ids) - refused and ("late" in refused) == (max_len <= 31) and "alternating" in refused
        assert f"{len(refused)} of {len(ds)} samples have no two consecutive supervised" in capsys.readouterr().err
        for path in paths:  # what is listed passes their normalizer, cut to its max_length
            assert normalize_offline_sample(load_feature_file(path), max_len=max_len)["hidden_states"].shape[1] <= max_len


def train(config: Path, *overrides, env=None):
    r = subprocess.run([sys.executable, "-m", "vx.train.specforge", "train", "-c", str(config), *overrides],
                       capture_output=True, text=True, timeout=900, cwd=config.parent, env=dict(os.environ, **(env or {})))
    steps = {int(n): float(x) for n, x in re.findall(r"step (\d+): \{.*?'loss': ([-\d.e]+)", r.stdout + r.stderr)}
    return r, [steps[n] for n in sorted(steps)]  # each step's loss (ranks log the same, interleaved)


def config(d: Path, tiny_model, data: str) -> Path:
    """A 2-layer DFlash drafter over the tiny target, on CPU: DDP (FSDP needs an accelerator), sdpa."""
    cfg = {"model": {"target_model_path": str(tiny_model), "draft_num_hidden_layers": 2, "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": data, "max_length": 512, "dataloader_num_workers": 2},
           "training": {"strategy": "dflash", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                        "max_steps": 6, "batch_size": 1, "num_anchors": 32, "log_interval": 1,
                        "learning_rate": 1e-3, "warmup_ratio": 0.0},
           "output_dir": str(d / "run")}
    path = d / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


def test_its_trainer_trains_from_a_local_output_and_its_loss_falls(outputs, tiny_model, tmp_path):
    from specforge.modeling.draft.dflash import build_target_layer_ids

    out = outputs["bf16"]
    r, losses = train(config(tmp_path, tiny_model, str(out)))
    assert r.returncode == 0, r.stderr[-3000:]
    want = build_target_layer_ids(8, 2)  # what its DFlash draft reads, by its own rule
    assert f"vx: SpecForge's DFlash draft reads target layers {want}" in r.stderr
    assert "1 of 24 samples have no two consecutive supervised tokens" in r.stderr
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert not list(tmp_path.rglob("*.ckpt")) and not list(out.rglob("*.ckpt"))


def test_two_ranks_it_launches_train_from_an_s3_output(outputs, tiny_model, tmp_path):
    from s3_faults import free_port
    from test_s3 import CREDS, start_s3

    os.environ.update(CREDS)
    server, url, client = start_s3(free_port())
    try:
        out = outputs["bf16"]
        for f in sorted(out.iterdir()):
            if f.is_file():
                client.upload_file(str(f), "vx-out", f"bf16/{f.name}")
        cache = tmp_path / "cache"
        r, losses = train(config(tmp_path, tiny_model, "s3://vx-out/bf16"), "deployment.trainer.nproc_per_node=2",
                          "training.max_steps=3", env={"VX_SPECFORGE_ENDPOINT_URL": url,
                                                       "VX_SPECFORGE_CACHE_DIR": str(cache)})
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
        caches = [p for p in cache.rglob("specforge-r*") if p.is_dir()]
        assert sorted(p.name for p in caches) == ["specforge-r0", "specforge-r1"]  # each rank read through vx
        assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) <= 2 * sum(
            f.stat().st_size for f in out.glob("shard-*"))
    finally:
        server.stop()


def test_an_s3_output_of_whole_file_zstd_shards_lists_and_reads_as_the_local_one(outputs, tiny_model, tmp_path):
    """--compress zstd shards have no byte ranges: their masks come from the cached whole shard."""
    from s3_faults import free_port
    from test_s3 import CREDS, start_s3

    from vx.train import specforge

    data = write_jsonl(tmp_path / "d.jsonl", [json.loads(line) for line in open(CHAT)][:10])
    zst = tmp_path / "zst"
    r = vx_cmd("extract", str(data), "-o", str(zst), "--backend", "hf", "--layers", "1,2,3,4,5",
               "--shard-size", "4", "--compress", "zstd")
    assert r.returncode == 0 and list(zst.glob("*.zst")), r.stderr[-2000:]
    os.environ.update(CREDS)
    server, url, client = start_s3(free_port())
    try:
        for f in sorted(zst.iterdir()):
            if f.is_file():
                client.upload_file(str(f), "vx-out", f"zst/{f.name}")
        os.environ.update(VX_SPECFORGE_ENDPOINT_URL=url, VX_SPECFORGE_CACHE_DIR=str(tmp_path / "cache"))
        specforge.use_layers([1, 5])
        local, remote = features(zst, 512).paths(), features("s3://vx-out/zst", 512).paths()
        assert [p.replace(str(zst), "s3://vx-out/zst") for p in local] == remote and len(remote) == 10
        for a, b in zip(local, remote):
            x, y = specforge.load_feature_file(a), specforge.load_feature_file(b)
            assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "loss_mask", "hidden_states"))
    finally:
        for k in ("VX_SPECFORGE_ENDPOINT_URL", "VX_SPECFORGE_CACHE_DIR"):
            os.environ.pop(k, None)
        server.stop()


def test_a_corrupt_shard_or_a_wrong_setting_stops_with_one_line(outputs, tiny_model, tmp_path):
    from specforge.runtime.data_plane.feature_store import load_feature_file

    from vx.train import specforge
    from vx.train.shard_cache import ShardCorrupt

    broken = tmp_path / "broken"
    shutil.copytree(outputs["bf16"], broken)
    bad = vx.open_dataset(broken).shards[1]
    with open(broken / bad["shard"], "r+b") as f:  # one flipped byte in the second shard's states
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    specforge.use_layers([1, 5])
    paths = features(broken, 512).paths()
    assert load_feature_file(paths[0])["hidden_states"].shape[0] == 1  # shard 0 reads
    with pytest.raises(ShardCorrupt, match=re.escape(bad["shard"])):
        load_feature_file(next(p for p in paths if int(p.rpartition("=")[2][:-5]) >= 8))
    r, losses = train(config(tmp_path, tiny_model, str(broken)), "training.max_steps=24")  # an epoch: it meets shard 1
    assert r.returncode == 1 and len(losses) < 23, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == f"vx: {broken / bad['shard']}: crc64nvme does not match the manifest " \
                                                "(a corrupt shard); vx verify lists every bad one"

    r, _ = train(config(tmp_path, tiny_model, str(outputs["fp8"])))  # it holds layers 2-4; the draft reads 1 and 5
    assert r.returncode == 2 and "vx: the DFlash draft reads target layers [1, 5]" in r.stderr, r.stderr[-2000:]
    r, _ = train(config(tmp_path, tiny_model, str(outputs["bf16"])), "training.strategy=eagle3")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("vx: vx serves SpecForge's DFlash")


def test_the_example_config_reads_vx_default_layers_by_specforges_rule():
    from specforge.config import load_config
    from specforge.modeling.draft.dflash import build_target_layer_ids

    from vx.data.layers import default_layer_ids

    cfg = load_config(str(ROOT / "examples" / "specforge_dflash.yaml"), ["deployment.trainer.nproc_per_node=8"])
    assert cfg.training.strategy == "dflash" and cfg.deployment.trainer.nproc_per_node == 8
    assert build_target_layer_ids(64, cfg.model.draft_num_hidden_layers) == default_layer_ids(64) == [1, 16, 31, 46, 61]
