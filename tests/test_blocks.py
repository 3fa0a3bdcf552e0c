"""Coded shards (`vx extract --compress blocks`): every reader gets the rows of the uncoded shard
of the same states, bit for bit, whatever rows it asks for (inside a block, across blocks, the
whole shard), in bf16, fp16 and fp8; the coded file is smaller; S3 row reads fetch one range of
blocks and refuse changed bytes. The reference is the uncoded shard read by safetensors itself."""

import os

import pytest
import torch
from safetensors import safe_open

import vx
from vx.store import blocks
from vx.store.format import read_manifest
from vx.store.output import prepare_output
from vx.store.reader import ShardFile, ShardHeader, coded_sizes
from vx.store.writer import ShardWriter

L, H = 3, 16
META = {"model": "m", "model_fingerprint": "f", "layer_ids": [0, 1, 2], "hidden_size": H}


def samples(n: int, seed: int = 0) -> list:
    """Residual-stream-like rows: normal values and two channels ~1000x larger (massive activations)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 1 + (i * 37) % 90
        h = torch.randn(t, L, H, generator=g)
        h[:, :, 3] *= 1000
        h[:, :, 11] *= -700
        out.append((f"id-{i}", list(range(t)), [i % 2] * t, h))
    return out


def write(out, rows, dtype: str, compress: str | None, shard_bytes: int = 40_000):
    prepare_output(out, dict(META, store_dtype=dtype), overwrite=False)
    w = ShardWriter(out, {"model": "m"}, shard_bytes, 0, L, H, dtype, compress=compress)
    for r in rows:
        w.add(*r)
    w.close()
    return read_manifest(out)


@pytest.fixture(params=["bf16", "fp16", "fp8"])
def pair(request, tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 1000)  # 5 or 10 rows a block: samples span many blocks
    rows = samples(24)
    raw, coded = write(tmp_path / "raw", rows, request.param, None), write(tmp_path / "coded", rows, request.param,
                                                                             "blocks")
    return request.param, tmp_path / "raw", raw, tmp_path / "coded", coded


def test_every_reader_gets_the_uncoded_rows_bit_for_bit(pair):
    dtype, raw_dir, raw, coded_dir, coded = pair
    assert [r["sample_ids"] for r in raw] == [r["sample_ids"] for r in coded] and len(coded) >= 2
    assert all(r["shard"].endswith(".safetensors") for r in coded)
    for r, c in zip(raw, coded):
        with safe_open(str(raw_dir / r["shard"]), "pt") as f:
            ref = {n: f.get_tensor(n) for n in f.keys()}
        with safe_open(str(coded_dir / c["shard"]), "pt") as f:  # still a safetensors file
            assert "hidden_states" not in f.keys() and "hidden_states.blocks" in f.keys()
        assert os.path.getsize(coded_dir / c["shard"]) == c["bytes"] < r["bytes"]
        whole, head = ShardFile(coded_dir / c["shard"]), ShardHeader(coded_dir / c["shard"])
        states = ref["hidden_states"]
        assert head.entries["hidden_states"]["shape"] == list(states.shape)
        assert torch.equal(whole.tensor("hidden_states").view(torch.uint8), states.view(torch.uint8))
        t = states.shape[0]
        for a in range(0, t, 3):  # every start, ends inside and across blocks
            for b in (a + 1, a + 4, a + 11, t):
                b = min(b, t)
                want = states[a:b].view(torch.uint8)
                assert torch.equal(whole.rows("hidden_states", a, b).view(torch.uint8), want), (a, b)
                out = torch.empty(b - a, L, H, dtype=states.dtype)
                assert torch.equal(head.rows("hidden_states", a, b, out).view(torch.uint8), want), (a, b)
        head.close()
    ds_raw, ds = vx.open_dataset(raw_dir), vx.open_dataset(coded_dir)
    for sid in ds_raw.ids:
        assert torch.equal(ds[sid]["hidden_states"], ds_raw[sid]["hidden_states"])
        assert torch.equal(ds[sid]["input_ids"], ds_raw[sid]["input_ids"])
    got = [b for b in vx.loader(str(coded_dir), 300, shuffle=False)]
    want = [b for b in vx.loader(str(raw_dir), 300, shuffle=False)]
    assert [b["sample_ids"] for b in got] == [b["sample_ids"] for b in want]
    assert all(torch.equal(x["hidden_states"], y["hidden_states"]) for x, y in zip(got, want))


def test_state_like_bf16_codes_to_under_three_quarters_of_its_bytes(tmp_path):
    rows = samples(40, seed=1)
    raw = sum(r["bytes"] for r in write(tmp_path / "raw", rows, "bf16", None, shard_bytes=10**9))
    coded = sum(r["bytes"] for r in write(tmp_path / "coded", rows, "bf16", "blocks", shard_bytes=10**9))
    assert coded < 0.75 * raw, coded / raw
    states, stored = coded_sizes(tmp_path / "coded")  # what vx selftest reports: the states alone
    assert states == sum(len(r[1]) for r in rows) * L * H * 2 and stored < 0.7 * states


def test_rows_from_s3_are_one_range_of_blocks_and_changed_bytes_are_refused(pair):
    from s3_faults import free_port
    from test_s3 import CREDS, start_s3

    from vx.store.remote_rows import RemoteRows, row_digest

    dtype, raw_dir, raw, coded_dir, coded = pair
    for k, v in CREDS.items():
        os.environ[k] = v
    server, url, client = start_s3(free_port())
    try:
        for c in coded:
            client.upload_file(str(coded_dir / c["shard"]), "vx-out", f"o/{c['shard']}")
        rows = RemoteRows("s3://vx-out/o", url)
        c = coded[1]
        with safe_open(str(raw_dir / raw[1]["shard"]), "pt") as f:
            ref = {n: f.get_tensor(n) for n in f.keys()}
        offsets = ref["offsets"].tolist()
        e = rows.header(c["shard"])[0]["hidden_states"]  # read once, kept
        for i in range(len(offsets) - 1):
            a, b = offsets[i], offsets[i + 1]
            want = {n: ref[n][a:b] for n in ("hidden_states", "hidden_scales", "input_ids") if n in ref}
            rows.bytes_read = 0
            got = rows.get(c["shard"], a, b, row_digest(want))
            assert got is not None and torch.equal(got["input_ids"], want["input_ids"])
            k0, k1 = a // e["coded"]["block_rows"], (b - 1) // e["coded"]["block_rows"]
            scales = (b - a) * L * 4 if dtype == "fp8" else 0  # fp8: a float32 scale per token and layer
            assert rows.bytes_read == e["coded"]["index"][k1 + 1] - e["coded"]["index"][k0] + scales + 4 * (b - a)
        data = bytearray((coded_dir / c["shard"]).read_bytes())
        data[-(c["bytes"] // 3)] ^= 0xFF  # a byte inside the coded blocks
        client.put_object(Bucket="vx-out", Key=f"o/{c['shard']}", Body=bytes(data))
        fresh = RemoteRows("s3://vx-out/o", url)
        results = [fresh.get(c["shard"], offsets[i], offsets[i + 1],
                             row_digest({n: ref[n][offsets[i]:offsets[i + 1]] for n in
                                         ("hidden_states", "hidden_scales", "input_ids") if n in ref}))
                   for i in range(len(offsets) - 1)]
        assert any(r is None for r in results)  # the rows in the changed block: refused, never wrong
    finally:
        server.stop()
