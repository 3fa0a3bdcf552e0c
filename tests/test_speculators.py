"""speculators (vLLM's drafter trainer) trains on a vx output in place, with its own code: its
layer rules agree with vx's presets, its ArrowDataset reads rows through vx's backend equal to
vx.open_dataset's, its collate function, DFlash model and loss train a drafter on CPU (the loop
around them mirrors its Trainer, which needs a CUDA device), and a shard that fails its checksum is
handled by its --on-missing policy; the same from an S3 output (moto over HTTP), its shards read
through a bounded, checked cache. No state is copied: the export holds ids and masks only."""

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd

import vx

CHAT = ROOT / "examples" / "chat.jsonl"
DFLASH_ARGS = ("--speculator-type", "dflash", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
               "--total-seq-len", "256", "--max-anchors", "32", "--block-size", "4", "--num-workers", "0")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model):
    """24 conversations of the embedded default extracted with --layers speculators-dflash (bf16 and
    fp8, several shards each), each exported for speculators."""
    d = tmp_path_factory.mktemp("speculators")
    data = write_jsonl(d / "d.jsonl", [json.loads(line) for line in open(CHAT)][:24])
    runs = {}
    for dtype in ("bf16", "fp8"):
        out, dest = d / dtype, d / f"{dtype}-index"
        r = vx_cmd("extract", str(data), "-o", str(out), "--backend", "hf", "--layers", "speculators-dflash",
                   "--store-dtype", dtype, "--shard-size", "2", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        e = vx_cmd("export", str(out), "--to", "speculators", "-o", str(dest), "--json")
        assert e.returncode == 0, e.stderr[-2000:]
        runs[dtype] = out, dest, json.loads(e.stdout)
    return runs


def test_the_presets_are_speculators_own_layer_rules(tmp_path, tiny_model):
    from speculators.models.utils import resolve_target_layer_ids

    from vx.data.layers import default_layer_ids, preset_layer_ids

    for n in (8, 64):
        cfg = json.loads((tiny_model / "config.json").read_text())
        text = cfg.get("text_config") or cfg
        text["num_hidden_layers"], text["layer_types"] = n, (text["layer_types"] * n)[:n]
        verifier = tmp_path / f"v{n}"
        verifier.mkdir()
        (verifier / "config.json").write_text(json.dumps(cfg))
        with pytest.warns(UserWarning):  # speculators warns that it picked its default targets
            theirs = resolve_target_layer_ids(None, str(verifier))
        ours = preset_layer_ids("speculators", n)
        assert [k + 1 for k in ours[:-1]] == theirs and ours[-1] == n - 1  # their id j = HF hidden_states[j]
        dflash = preset_layer_ids("speculators-dflash", n)
        assert dflash == sorted(set(default_layer_ids(n)) | {n - 1})
        assert resolve_target_layer_ids([k + 1 for k in dflash[:-1]], str(verifier))  # valid targets for it
    assert preset_layer_ids("speculators-dflash", 64) == [1, 16, 31, 46, 61, 63]


def test_speculators_dataset_yields_what_vx_reads_bit_equal_in_bf16(exported):
    from speculators.train.data import ArrowDataset

    from vx.train.speculators import VxTransfer

    for dtype in ("bf16", "fp8"):
        out, dest, info = exported[dtype]
        assert info["layer_ids"] == [1, 2, 3, 4, 5, 7] and info["target_layer_ids"] == [2, 3, 4, 5, 6]
        assert not any(f.suffix == ".safetensors" for f in dest.rglob("*")), "the export copies no state"
        theirs = ArrowDataset(max_len=4096, datapath=str(dest), transfer=VxTransfer(dest), on_missing="raise")
        ours = vx.open_dataset(out)
        assert len(theirs) == len(ours) == 24
        for i in (0, 7, 23):
            row = theirs[i]
            sid = theirs.data.with_format(None)[i]["vx_id"]
            want = ours[sid]
            h = want["hidden_states"]  # [T, 6, H]; fp8 dequantized by vx's reader
            assert torch.equal(row["input_ids"], want["input_ids"].long())
            assert torch.equal(row["loss_mask"], want["loss_mask"].long())
            assert torch.equal(row["hidden_states"], h[:, :5].flatten(1))          # the drafter's targets
            assert torch.equal(row["verifier_last_hidden_states"], h[:, 5])         # layer 7 of 8, pre-norm
            if dtype == "fp8":  # within the fp8 bound of the bf16 states of the same sample
                ref = vx.open_dataset(exported["bf16"][0])[sid]["hidden_states"].float()
                amax = ref.abs().amax(dim=-1, keepdim=True)
                assert ((h.float() - ref).abs() <= amax / 16 + 1e-2 * amax).all()


def dflash_parts(dest, tiny_model, *extra):
    """speculators' own pieces for a DFlash run: config resolution, draft model, data loader."""
    import argparse

    from speculators.train import cli
    from speculators.train.config import TrainConfig

    import vx.train.speculators  # noqa: F401  (registers the backend before speculators' config module)

    args = argparse.Namespace(**TrainConfig.resolve([
        "--verifier-name-or-path", str(tiny_model), "--data-path", str(dest), "--hidden-states-backend", "vx",
        "--target-layer-ids", "2", "3", "4", "5", "6", "--on-missing", "skip", "--save-path", str(dest / "ckpt"),
        *DFLASH_ARGS, *extra]).flatten())
    d2t, t2d, vocab = cli.parse_vocab_mappings(args)
    model_class = cli.SpeculatorModel.registry[args.speculator_type]
    model = cli.build_draft_model(args, model_class, t2d, d2t, vocab)
    transfer = cli.HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    train, _ = cli.create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=model.config.transformer_layer_config.hidden_size, num_target_layers=len(model.target_layer_ids),
        num_workers=args.num_workers, prefetch_factor=args.prefetch_factor, preprocess=None,
        train_data_ratio=args.train_data_ratio, seed=args.seed)
    kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    return model, train, kwargs


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_dflash_drafter_trains_with_speculators_code_and_its_loss_falls(exported, tiny_model, dtype):
    """An epoch of speculators' loader, then its first batch 20 times more."""
    torch.manual_seed(0)
    _, dest, _ = exported[dtype]
    model, train, kwargs = dflash_parts(dest, tiny_model)
    assert model.target_layer_ids == [2, 3, 4, 5, 6]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()

    def step(batch) -> float:  # speculators' Trainer step, on CPU: autocast to the states' dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    t0 = time.perf_counter()
    batches = list(train)
    epoch = [step(b) for b in batches]
    assert len(epoch) >= 10 and all(torch.isfinite(torch.tensor(epoch)))
    fit = [step(batches[0]) for _ in range(20)]
    print(f"{dtype}: epoch of {len(epoch)} steps {epoch[0]:.3f} -> {epoch[-1]:.3f}; one batch {fit[0]:.3f} -> "
          f"{fit[-1]:.3f}; {time.perf_counter() - t0:.1f} s")
    losses = epoch + fit  # the drafter's targets are a random verifier's: it learns slowly, but it learns
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses


def test_a_shard_failing_its_checksum_is_missing_as_on_missing_says(exported, tmp_path):
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    from vx.train.speculators import VxTransfer

    out, dest, _ = exported["bf16"]
    broken, index = tmp_path / "out", tmp_path / "index"
    shutil.copytree(out, broken)
    ds = vx.open_dataset(broken)
    bad = ds.shards[1]
    with open(broken / bad["shard"], "r+b") as f:  # one flipped byte in the states of the second shard
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert vx_cmd("export", str(broken), "--to", "speculators", "-o", str(index)).returncode == 0
    skip = ArrowDataset(max_len=4096, datapath=str(index), transfer=VxTransfer(index), on_missing="skip")
    ids = skip.data.with_format(None)["vx_id"]
    missing = {i for i in range(len(skip)) if isinstance(skip[i], SampleUnavailable)}
    assert {ids[i] for i in missing} == set(bad["sample_ids"]) and missing
    strict = ArrowDataset(max_len=4096, datapath=str(index), transfer=VxTransfer(index), on_missing="raise")
    with pytest.raises(RuntimeError, match="Failed to load hidden states"):
        strict[min(missing)]


@pytest.fixture(scope="module")
def s3_outputs(exported, tiny_model):
    """The bf16 and fp8 outputs on an S3 endpoint (moto over HTTP), each exported from there."""
    import os

    from s3_faults import free_port
    from test_s3 import CREDS, start_s3

    os.environ.update(CREDS)
    server, url, client = start_s3(free_port())
    runs = {}
    for dtype in ("bf16", "fp8"):
        out = exported[dtype][0]
        for f in sorted(out.iterdir()):
            if f.is_file():
                client.upload_file(str(f), "vx-out", f"{dtype}/{f.name}")
        dest = out.parent / f"{dtype}-s3-index"
        e = vx_cmd("export", f"s3://vx-out/{dtype}", "--endpoint-url", url, "--to", "speculators", "-o", str(dest),
                   "--json")
        assert e.returncode == 0, e.stderr[-2000:]
        runs[dtype] = out, dest, json.loads(e.stdout)
    yield url, client, runs
    server.stop()


def disk_bytes(d) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.exists() else 0


@pytest.mark.parametrize("mode", ["shards", "rows"])
def test_from_s3_the_rows_are_the_same_and_the_disk_stays_bounded(s3_outputs, tmp_path, mode):
    """shards: whole shards through the cache vx.loader uses, bounded; rows: ranged GETs of each
    row's bytes, checked against its digest, no disk at all (what auto picks when the cache
    cannot hold the output)."""
    from speculators.train.data import ArrowDataset

    from vx.train.speculators import VxTransfer

    _, _, runs = s3_outputs
    for dtype in ("bf16", "fp8"):
        out, dest, info = runs[dtype]
        assert info["output"] == f"s3://vx-out/{dtype}" and info["rows"] == 24 and info["refused"] == 0
        assert not any(f.suffix == ".safetensors" for f in dest.rglob("*")), "the export copies no state"
        ours = vx.open_dataset(out)
        largest = max(r["bytes"] for r in ours.shards)
        bound = 2 * largest  # two shards of the twelve: most rows need a fetch
        cache = tmp_path / dtype
        transfer = VxTransfer(dest, cache_dir=str(cache), cache_gb=bound / 1e9, s3_read="auto")
        assert transfer.s3_read == "rows"  # the cache cannot hold the output
        transfer = VxTransfer(dest, cache_dir=str(cache), cache_gb=bound / 1e9, s3_read=mode)
        theirs = ArrowDataset(max_len=4096, datapath=str(dest), transfer=transfer, on_missing="raise")
        ids = theirs.data.with_format(None)["vx_id"]
        peak = 0
        for i in (0, 23, 5, 11, 17, 2, 20, 8, 14, 1):  # across the shards, out of order
            row, want = theirs[i], ours[ids[i]]
            h = want["hidden_states"]
            assert torch.equal(row["input_ids"], want["input_ids"].long())
            assert torch.equal(row["hidden_states"], h[:, :5].flatten(1))
            assert torch.equal(row["verifier_last_hidden_states"], h[:, 5])
            peak = max(peak, disk_bytes(cache))
        if mode == "shards":
            assert 0 < peak <= bound + largest and transfer._shards.peak_bytes <= bound + largest, (peak, bound)
        else:
            states = sum(ours[ids[i]]["hidden_states"].numel() for i in (0, 23, 5, 11, 17, 2, 20, 8, 14, 1))
            assert peak == 0 and transfer._rows.bytes_read < 1.2 * states * (2 if dtype == "bf16" else 1) + 2e5
        transfer.close()


def test_a_dflash_drafter_trains_from_an_s3_output(s3_outputs, tiny_model, tmp_path):
    torch.manual_seed(0)
    out, dest, _ = s3_outputs[2]["bf16"]
    largest = max(r["bytes"] for r in vx.open_dataset(out).shards)
    model, train, kwargs = dflash_parts(dest, tiny_model, "--vx-cache-dir", str(tmp_path), "--vx-s3-read", "shards",
                                        "--vx-cache-gb", str(2 * largest / 1e9))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in train:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) >= 10 and all(torch.isfinite(torch.tensor(losses)))
    assert train.dataset.transfer._shards.peak_bytes <= 3 * largest


def test_a_corrupt_s3_shard_is_missing_as_on_missing_says(s3_outputs, tmp_path):
    """Replaced after the export (found by the shard's checksum or the rows' digests), or before it
    (the export refuses the shard): exactly its samples are missing."""
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    from vx.train.speculators import VxTransfer

    url, client, runs = s3_outputs
    out, dest, _ = runs["fp8"]
    bad = vx.open_dataset(out).shards[3]
    client.put_object(Bucket="vx-out", Key=f"fp8/{bad['shard']}", Body=b"not the shard the manifest names")
    late = tmp_path / "late-index"
    e = vx_cmd("export", "s3://vx-out/fp8", "--endpoint-url", url, "--to", "speculators", "-o", str(late), "--json")
    assert e.returncode == 0 and json.loads(e.stdout)["refused"] == len(bad["sample_ids"]), e.stderr[:3000]
    assert f"{bad['shard']}: crc64nvme does not match the manifest" in e.stderr
    try:
        for index, mode in ((dest, "shards"), (dest, "rows"), (late, "rows")):
            transfer = VxTransfer(index, cache_dir=str(tmp_path / mode), s3_read=mode)
            skip = ArrowDataset(max_len=4096, datapath=str(index), transfer=transfer, on_missing="skip")
            ids = skip.data.with_format(None)["vx_id"]
            missing = {ids[i] for i in range(len(skip)) if isinstance(skip[i], SampleUnavailable)}
            assert missing == set(bad["sample_ids"]), (index, mode)
            transfer.close()
    finally:
        client.upload_file(str(out / bad["shard"]), "vx-out", f"fp8/{bad['shard']}")


def test_speculators_command_line_offers_the_vx_backend():
    r = subprocess.run([sys.executable, "-m", "vx.train.speculators", "train", "--help"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    choices = r.stdout[r.stdout.index("--hidden-states-backend"):][:300]
    assert "vx" in choices and "file" in choices
