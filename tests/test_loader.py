"""vx.loader: the trainer's side. Every sample exactly once per epoch across ranks and DataLoader
workers, the same batch count on every rank, token budgets, a deterministic order per (seed,
epoch), exact resume mid-epoch, S3 through a bounded, checksummed cache, fp8 dequantized; and a
draft head trained through it under torchrun. Checks compare against vx.open_dataset (the
map-style reader) and against counts made here."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vx
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd
from test_s3 import CREDS, start_s3
from vx.errors import VxError

BUDGET = 600


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_model):
    """Two extractions of 60 samples (5..330 tokens) in many small shards: bf16 and fp8."""
    d = tmp_path_factory.mktemp("loader")
    rows = [{"id": f"x{i}", "text": f"row {i} " + "word " * (2 + (i * 37) % 160)} for i in range(60)]
    data = write_jsonl(d / "d.jsonl", rows)
    outs = {}
    for dtype in ("bf16", "fp8"):
        out = d / dtype
        r = vx_cmd("extract", str(data), "-o", str(out), "--backend", "hf", "--store-dtype", dtype,
                   "--shard-size", "0.4", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        outs[dtype] = out
    return outs


def epoch_ids(path, world, **kw):
    per_rank = []
    for r in range(world):
        per_rank.append([b["sample_ids"] for b in vx.loader(path, BUDGET, rank=r, world_size=world, **kw)])
    return per_rank


def test_every_sample_once_per_epoch_with_equal_batch_counts_on_1_2_3_ranks(outputs):
    ds = vx.open_dataset(outputs["bf16"])
    assert len(ds.shards) > 10
    for world in (1, 2, 3):
        per_rank = epoch_ids(outputs["bf16"], world, seed=3)
        assert len({len(b) for b in per_rank}) == 1, [len(b) for b in per_rank]  # equal batch counts
        seen = collections.Counter(sid for batches in per_rank for b in batches for sid in b)
        assert sorted(seen) == sorted(ds.ids) and set(seen.values()) == {1}


def test_batches_hold_whole_samples_within_the_token_budget_equal_to_the_reader(outputs):
    ds = vx.open_dataset(outputs["bf16"])
    for b in vx.loader(outputs["bf16"], BUDGET, seed=1):
        cu = b["cu_seqlens"].tolist()
        assert cu[-1] == b["hidden_states"].shape[0] == len(b["input_ids"]) == len(b["position_ids"])
        assert cu[-1] <= BUDGET or len(b["sample_ids"]) == 1
        for k, sid in enumerate(b["sample_ids"]):
            ref = ds[sid]
            a, z = cu[k], cu[k + 1]
            assert torch.equal(b["hidden_states"][a:z], ref["hidden_states"])
            assert b["input_ids"][a:z].tolist() == ref["input_ids"].tolist()
            assert b["loss_mask"][a:z].tolist() == ref["loss_mask"].tolist()
            assert b["position_ids"][a:z].tolist() == list(range(z - a))


def test_the_order_is_fixed_by_seed_and_epoch(outputs):
    a = epoch_ids(outputs["bf16"], 2, seed=5, epoch=0)
    assert a == epoch_ids(outputs["bf16"], 2, seed=5, epoch=0)
    assert a != epoch_ids(outputs["bf16"], 2, seed=5, epoch=1)
    assert a != epoch_ids(outputs["bf16"], 2, seed=6, epoch=0)


def test_dataloader_workers_yield_the_rank_batches_in_order_without_duplicates(outputs):
    from torch.utils.data import DataLoader

    for rank in range(2):
        direct = [b["sample_ids"] for b in vx.loader(outputs["bf16"], BUDGET, rank=rank, world_size=2, seed=2)]
        dl = DataLoader(vx.loader(outputs["bf16"], BUDGET, rank=rank, world_size=2, seed=2), batch_size=None,
                        num_workers=2)
        assert [b["sample_ids"] for b in dl] == direct


def test_resume_mid_epoch_gives_exactly_the_batches_an_uninterrupted_run_gives(outputs):
    full = list(vx.loader(outputs["bf16"], BUDGET, rank=1, world_size=2, seed=9, epoch=4))
    first = vx.loader(outputs["bf16"], BUDGET, rank=1, world_size=2, seed=9, epoch=4)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = vx.loader(outputs["bf16"], BUDGET, rank=1, world_size=2, seed=9)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - 3
    for got, want in zip(rest, full[3:]):
        assert got["sample_ids"] == want["sample_ids"] and torch.equal(got["hidden_states"], want["hidden_states"])


def test_fp8_batches_equal_the_readers_dequantized_states(outputs):
    ds = vx.open_dataset(outputs["fp8"])
    n = 0
    for b in vx.loader(outputs["fp8"], BUDGET, flatten_layers=True):
        cu = b["cu_seqlens"].tolist()
        for k, sid in enumerate(b["sample_ids"]):
            ref = ds[sid]["hidden_states"]
            assert b["hidden_states"].dtype == ref.dtype == torch.bfloat16
            assert torch.equal(b["hidden_states"][cu[k]:cu[k + 1]], ref.flatten(1))
            n += 1
    assert n == len(ds)


@pytest.fixture(scope="module")
def s3_copy(outputs):
    from s3_faults import free_port

    for k, v in CREDS.items():
        os.environ[k] = v
    server, url, client = start_s3(free_port())
    for name in ("bf16", "fp8"):
        for f in sorted(outputs[name].iterdir()):
            if f.is_file() and not f.name.startswith("."):
                client.upload_file(str(f), "vx-out", f"{name}/{f.name}")
    yield url, client
    server.stop()


def tree_bytes(root: Path) -> int:
    """The bytes of the files under root now; a fetch's temporary file may be renamed while walking."""
    total = 0
    for f in root.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except FileNotFoundError:
            continue
    return total


def test_s3_reads_the_same_epoch_through_a_cache_that_stays_within_its_bound(outputs, s3_copy, tmp_path):
    url, _ = s3_copy
    ds = vx.open_dataset(outputs["bf16"])
    largest = max(r["bytes"] for r in ds.shards)
    cache_gb = 3 * largest / 1e9
    local = list(vx.loader(outputs["bf16"], BUDGET, seed=4))
    remote = vx.loader("s3://vx-out/bf16", BUDGET, seed=4, endpoint_url=url, cache_dir=str(tmp_path / "cache"),
                       cache_gb=cache_gb, prefetch=2)
    peak = 0
    for got, want in zip(remote, local):
        assert got["sample_ids"] == want["sample_ids"] and torch.equal(got["hidden_states"], want["hidden_states"])
        used = tree_bytes(tmp_path / "cache")
        peak = max(peak, used)
    assert peak <= cache_gb * 1e9 + largest, (peak, cache_gb * 1e9, largest)
    assert remote.shards.peak_bytes <= cache_gb * 1e9 + largest


def test_a_corrupted_s3_shard_is_refused_with_a_clear_error(outputs, s3_copy, tmp_path):
    url, client = s3_copy
    shard = vx.open_dataset(outputs["fp8"]).shards[2]["shard"]
    client.put_object(Bucket="vx-out", Key=f"fp8/{shard}", Body=b"not the shard the manifest names")
    with pytest.raises(VxError, match=f"{shard}: crc64nvme does not match the manifest"):
        for _ in vx.loader("s3://vx-out/fp8", BUDGET, shuffle=False, endpoint_url=url,
                           cache_dir=str(tmp_path / "cache")):
            pass


def test_a_corrupted_local_shard_is_refused_before_any_of_its_rows_is_read(outputs, tmp_path):
    import shutil

    from vx.train.shard_cache import ShardCorrupt

    copy = tmp_path / "copy"
    shutil.copytree(outputs["fp8"], copy)
    shard = vx.open_dataset(copy).shards[1]["shard"]
    data = bytearray((copy / shard).read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one state
    (copy / shard).write_bytes(data)
    with pytest.raises(ShardCorrupt, match=f"{shard}: crc64nvme does not match the manifest"):
        for _ in vx.loader(str(copy), BUDGET, shuffle=False):
            pass


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_loader_left_before_its_epoch_ends_exits_quietly(outputs, s3_copy, tmp_path, where):
    """What a trainer that stops at its max steps does, or a user taking two batches to look:
    iterate part of an epoch, keep state_dict(), exit. Nothing is printed at exit, and the state
    says where to resume."""
    url, _ = s3_copy
    path = str(outputs["bf16"]) if where == "local" else "s3://vx-out/bf16"
    code = (f"import vx\ndata = vx.loader({path!r}, {BUDGET}, seed=1, endpoint_url={url!r}, "
            f"cache_dir={str(tmp_path / 'cache')!r})\n"
            "batches = iter(data)\nnext(batches), next(batches)\nprint(data.state_dict()['position'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **CREDS))
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-3000:]
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_draft_head_trains_under_torchrun_on_2_processes(outputs):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(ROOT / "examples" / "train_draft.py"), str(outputs["bf16"]), "--steps", "40",
                        "--tokens-per-batch", "1024"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == 40
    assert result["final_loss"] < 0.5 * result["first_loss"], result
