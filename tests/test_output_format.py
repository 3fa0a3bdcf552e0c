"""Shards round-trip bit-exactly; only what the manifest records is visible."""

import json

import torch
from safetensors import safe_open

import vx
from vx.output import prepare_output
from vx.shards import MANIFEST, ShardWriter, read_manifest

L, H = 3, 16
META = {"model": "m", "layer_ids": [0, 1, 2], "store_dtype": "bf16", "hidden_size": H}


def write(out, samples, shard_bytes=10_000, dtype=torch.bfloat16):
    state = prepare_output(out, META, overwrite=False)
    w = ShardWriter(out, {"model": "m"}, shard_bytes, state.next_shard, L, H, dtype)
    for sid, ids, mask, h in samples:
        w.add(sid, ids, mask, h)
    w.close()
    return w


def make(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 1 + (i * 37) % 90
        out.append((f"id-{i}", list(range(t)), [i % 2] * t, torch.randn(t, L, H, generator=g).to(torch.bfloat16)))
    return out


def test_write_read_round_trip_is_bit_exact(tmp_path):
    samples = make(25)
    w = write(tmp_path, samples)
    assert w.committed_shards > 1  # several shards at this size
    ds = vx.open_dataset(tmp_path)
    assert len(ds) == 25 and ds.ids == [s[0] for s in samples]
    for i, (sid, ids, mask, h) in enumerate(samples):
        for item in (ds[i], ds[sid]):
            assert item["id"] == sid
            assert torch.equal(item["hidden_states"], h)
            assert item["input_ids"].dtype == torch.int32 and item["input_ids"].tolist() == ids
            assert item["loss_mask"].dtype == torch.uint8 and item["loss_mask"].tolist() == mask


def test_shards_are_standard_safetensors_with_the_documented_layout(tmp_path):
    samples = make(4)
    write(tmp_path, samples, shard_bytes=10**9)
    rec = read_manifest(tmp_path)[0]
    with safe_open(str(tmp_path / rec["shard"]), "pt") as f:
        assert set(f.keys()) == {"hidden_states", "input_ids", "loss_mask", "offsets"}
        total = sum(len(s[1]) for s in samples)
        assert list(f.get_tensor("hidden_states").shape) == [total, L, H]
        assert f.get_tensor("offsets").tolist()[-1] == total
        assert json.loads(f.metadata()["sample_ids"]) == [s[0] for s in samples]
    assert rec["num_tokens"] == total and rec["bytes"] == (tmp_path / rec["shard"]).stat().st_size


def test_torn_temp_files_and_torn_manifest_lines_are_ignored(tmp_path):
    write(tmp_path, make(5), shard_bytes=10**9)
    (tmp_path / ".shard-00001.safetensors.tmp").write_bytes(b"\x00" * 100)  # crash mid-write
    (tmp_path / "shard-00007.safetensors").write_bytes(b"garbage")  # renamed, never committed
    with open(tmp_path / MANIFEST, "a") as f:
        f.write('{"shard": "shard-0000')  # crash mid-append
    ds = vx.open_dataset(tmp_path)
    assert len(ds) == 5
    assert torch.equal(ds[4]["hidden_states"], make(5)[4][3])


def test_a_rerun_repairs_the_output_and_continues_numbering(tmp_path):
    write(tmp_path, make(5), shard_bytes=10**9)
    (tmp_path / ".shard-00001.safetensors.tmp").write_bytes(b"x")
    (tmp_path / "shard-00001.safetensors").write_bytes(b"garbage")
    with open(tmp_path / MANIFEST, "a") as f:
        f.write('{"torn')
    state = prepare_output(tmp_path, META, overwrite=False)
    assert state.committed_ids == {f"id-{i}" for i in range(5)} and state.next_shard == 1
    assert not (tmp_path / ".shard-00001.safetensors.tmp").exists()
    assert not (tmp_path / "shard-00001.safetensors").exists()
    assert (tmp_path / MANIFEST).read_text().endswith("\n")
