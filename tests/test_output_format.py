"""Shards round-trip bit-exactly; only what the manifest records is visible."""

import json

import torch
from safetensors import safe_open

import vx
from vx.store.output import prepare_output
from vx.store.format import MANIFEST, read_manifest
from vx.store.writer import ShardWriter

L, H = 3, 16
META = {"model": "m", "model_fingerprint": "f", "layer_ids": [0, 1, 2], "store_dtype": "bf16", "hidden_size": H}


def write(out, samples, shard_bytes=10_000, dtype="bf16"):
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


def test_fp8_round_trip_is_within_the_stated_bound(tmp_path):
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(50, L, H, generator=g) * torch.logspace(-3, 2, 50).view(50, 1, 1)).to(torch.bfloat16)
    write(tmp_path, [("a", list(range(50)), [1] * 50, h)], dtype="fp8")
    back = vx.open_dataset(tmp_path)["a"]["hidden_states"]
    assert back.dtype == torch.bfloat16 and back.shape == h.shape
    x = h.float()
    amax = x.abs().amax(dim=2, keepdim=True)
    err = (back.float() - x).abs()
    assert (err <= amax / 16 + 1e-12).all()  # docs/output-format.md: max |x - dequant(x)| <= amax / 16 per token and layer
    rec = read_manifest(tmp_path)[0]
    assert rec["bytes"] < 50 * (L * H + 4 * L + 5) + 4096  # ~1 byte per value + a scale per token-layer


def test_samples_with_nan_or_an_all_zero_layer_are_rejected_never_committed(tmp_path):
    good = make(2)
    nan = torch.ones(4, L, H, dtype=torch.bfloat16)
    nan[2, 1, 3] = float("nan")
    zero = torch.ones(4, L, H, dtype=torch.bfloat16)
    zero[:, 2] = 0
    reasons = []
    state = prepare_output(tmp_path, META, overwrite=False)
    w = ShardWriter(tmp_path, {}, 10**9, state.next_shard, L, H, "bf16", on_reject=lambda i, r, line: reasons.append((i, r)))
    w.add(*good[0])
    w.add("nan", [1, 2, 3, 4], [1] * 4, nan)
    w.add("zero", [1, 2, 3, 4], [1] * 4, zero)
    w.add(*good[1])
    w.close()
    assert [i for i, _ in reasons] == ["nan", "zero"]
    assert "NaN" in reasons[0][1] and "all zero" in reasons[1][1]
    assert vx.open_dataset(tmp_path).ids == ["id-0", "id-1"]


def test_zstd_shards_round_trip_bit_exact_and_are_smaller(tmp_path):
    samples = make(12)
    state = prepare_output(tmp_path, META, overwrite=False)
    w = ShardWriter(tmp_path, {}, 10**9, state.next_shard, L, H, "bf16", compress="zstd")
    for s in samples:
        w.add(*s)
    w.close()
    [rec] = read_manifest(tmp_path)
    assert rec["shard"].endswith(".safetensors.zst")
    raw = sum(len(s[1]) for s in samples) * L * H * 2
    assert rec["bytes"] < raw  # random-normal bf16 still compresses (exponent bytes)
    ds = vx.open_dataset(tmp_path)
    for sid, ids, mask, h in samples:
        assert torch.equal(ds[sid]["hidden_states"], h) and ds[sid]["input_ids"].tolist() == ids
    # a rerun sees the compressed shard as committed
    assert prepare_output(tmp_path, META, overwrite=False).committed_ids == {s[0] for s in samples}


def crc64nvme_reference(data: bytes) -> int:
    """CRC-64/NVME from its definition (reflected polynomial 0x9a6c9329ac4bc9b5, init and final
    xor all ones), bit by bit: independent of the awscrt code vx uses."""
    crc = 0xFFFFFFFFFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x9A6C9329AC4BC9B5 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFFFFFFFFFF


def test_each_shard_has_one_checksum_crc64nvme_as_s3_writes_it_and_older_sha256_records_still_verify(tmp_path):
    import base64
    import hashlib

    from test_cli import vx_cmd

    assert crc64nvme_reference(b"123456789") == 0xAE8B14860A799888  # the catalogued check value
    out = tmp_path / "o"
    write(out, make(6), shard_bytes=4_000)
    (out / "vx.json").write_text(json.dumps(dict(META, format="vx-1", num_layers=L, model_type="qwen3_5")))
    recs = read_manifest(out)
    for rec in recs:
        body = (out / rec["shard"]).read_bytes()
        assert "sha256" not in rec  # one checksum, computed once while writing
        assert rec["crc64nvme"] == base64.b64encode(crc64nvme_reference(body).to_bytes(8, "big")).decode()
    assert vx_cmd("verify", str(out), "--samples", "0").returncode == 0
    # shards committed by an older vx (sha256 records, here the first half) still verify with their sha256
    with open(out / MANIFEST, "w") as f:
        for i, rec in enumerate(recs):
            if i < len(recs) // 2:
                rec = {k: v for k, v in rec.items() if k != "crc64nvme"}
                rec["sha256"] = hashlib.sha256((out / rec["shard"]).read_bytes()).hexdigest()
            f.write(json.dumps(rec) + "\n")
    assert vx_cmd("verify", str(out), "--samples", "0").returncode == 0
    for name in (recs[0]["shard"], recs[-1]["shard"]):  # one flipped bit, in an old and in a new record's shard
        data = bytearray((out / name).read_bytes())
        data[-3] ^= 1
        (out / name).write_bytes(data)
    r = vx_cmd("verify", str(out), "--samples", "0")
    assert r.returncode == 1 and "2 bad" in r.stdout, r.stdout + r.stderr


def test_a_small_file_killed_before_its_rename_leaves_a_temp_the_next_writer_removes(tmp_path):
    import subprocess
    import sys

    from vx.store.lock import drop_dead_temps, temp_for
    from vx.store.progress_log import ProgressLog

    # a writer killed between writing progress.json's temp and renaming it
    code = ("import os, sys; from vx.store.lock import temp_for; from pathlib import Path; "
            "temp_for(Path(sys.argv[1]) / 'progress.json').write_text('{}'); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == 9
    mine = temp_for(tmp_path / "vx.json")
    mine.write_text("{}")  # a live writer's, mid-write
    (tmp_path / ".shard-00000.tmp").write_text("")  # the shard writer's own, not this scheme's
    left = sorted(p.name for p in tmp_path.glob(".*.tmp"))
    assert len(left) == 3
    ProgressLog(tmp_path)({"samples": 1})
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == sorted([mine.name, ".shard-00000.tmp"])
    assert json.loads((tmp_path / "progress.json").read_text()) == {"samples": 1}
    drop_dead_temps(tmp_path)
    assert mine.exists()
