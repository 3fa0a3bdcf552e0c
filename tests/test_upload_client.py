"""The uploader sends shards through awscrt's S3 client (C threads, off the driver's GIL), or
through boto3's transfer manager with VX_S3_CLIENT=boto3: either way a shard above the part size
goes as a multipart upload, S3 receives the manifest's full-object CRC64-NVME with it and checks
it, and the object holds the shard's bytes. The training loader's shard cache fetches through the
same client, in ranged GETs, and checks what arrived. A bad choice is one line. (The fault campaign fires
the upload's failpoints, multipart ones included, through the default client: test_fault_campaign.)"""

import json
import os

import pytest
from s3_faults import FaultyProxy, free_port
from test_s3 import CREDS, start_s3

from vx.errors import VxError
from vx.store.s3_client import parse_s3_url
from vx.store import checksum
from vx.store.uploader import Uploader

pytestmark = pytest.mark.xdist_group("s3-upload-client")


def committed(out, sizes):
    """Shards (safetensors files of random states, about `sizes` bytes) and the manifest lines the
    writer would have committed for them."""
    import torch
    from safetensors.torch import save_file

    out.mkdir()
    with open(out / "manifest.jsonl", "w") as m:
        for i, size in enumerate(sizes):
            name = f"shard-{i:05d}.safetensors"
            save_file({"hidden_states": torch.randn(size // 2048, 4, 256).to(torch.bfloat16),
                       "offsets": torch.tensor([0, size // 2048])}, str(out / name))
            size = (out / name).stat().st_size
            m.write(json.dumps({"shard": name, "bytes": size, checksum.ALGO: checksum.file_crc64(out / name),
                                "sample_ids": [f"s{i}"], "tokens": 1}) + "\n")


def moto(monkeypatch, client: str):
    """(port, server, boto3 client) of a fresh moto S3 server, vx set to use `client` against it."""
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VX_S3_CLIENT", client)
    port = free_port()
    server, _, s3 = start_s3(port)
    return port, server, s3


@pytest.mark.parametrize("client,agent", [("crt", "crt"), ("boto3", "boto3")])
def test_a_shard_goes_up_multipart_with_its_full_object_checksum(tmp_path, monkeypatch, client, agent):
    port, server, s3 = moto(monkeypatch, client)
    try:
        out = tmp_path / "out"
        committed(out, [12 << 20, 1 << 20])  # three 5 MiB parts, then one request
        with FaultyProxy(port) as proxy:
            summary = Uploader(out, parse_s3_url(f"s3://vx-out/{client}"), proxy.url, part_mb=5,
                               keep_local=True).start().finish()
        sizes = [json.loads(line)["bytes"] for line in (out / "manifest.jsonl").read_text().splitlines()]
        assert summary["uploaded_bytes"] == sum(sizes) and summary["upload_mb_s"] > 0
        shard0 = [(m, p) for m, p in proxy.seen if p.startswith(f"/vx-out/{client}/shard-00000")]
        assert [m for m, p in shard0 if p.endswith("?uploads")] == ["POST"]
        assert sum(m == "PUT" and "partNumber=" in p for m, p in shard0) == 3
        assert [m for m, p in shard0 if "uploadId=" in p and "partNumber=" not in p] == ["POST"]  # complete
        sent = [a.lower() for (m, p), a in zip(proxy.seen, proxy.agents) if "/shard-" in p and m in ("PUT", "POST")]
        assert sent and all(agent in a for a in sent), set(sent)
        for line in (out / "manifest.jsonl").read_text().splitlines():
            rec = json.loads(line)
            head = s3.head_object(Bucket="vx-out", Key=f"{client}/{rec['shard']}", ChecksumMode="ENABLED")
            assert head["ChecksumCRC64NVME"] == rec[checksum.ALGO] and head.get("ChecksumType", "FULL_OBJECT").upper() == "FULL_OBJECT"
            body = s3.get_object(Bucket="vx-out", Key=f"{client}/{rec['shard']}")["Body"].read()
            assert body == (out / rec["shard"]).read_bytes()
        assert not s3.list_multipart_uploads(Bucket="vx-out").get("Uploads")
    finally:
        server.stop()


@pytest.mark.parametrize("client", ["crt", "boto3"])
def test_the_loaders_shard_cache_fetches_through_the_same_client_and_checks_what_arrived(tmp_path, monkeypatch, client):
    from vx.train.shard_cache import S3Shards, ShardCorrupt

    port, server, s3 = moto(monkeypatch, client)
    try:
        out = tmp_path / "out"
        committed(out, [20 << 20, 3 << 20])
        records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
        for rec in records:
            s3.upload_file(str(out / rec["shard"]), "vx-out", f"dl-{client}/{rec['shard']}")
        s3.put_object(Bucket="vx-out", Key=f"dl-{client}/{records[1]['shard']}", Body=os.urandom(3 << 20))  # replaced
        with FaultyProxy(port) as proxy:
            shards = S3Shards(f"s3://vx-out/dl-{client}", proxy.url, records, tmp_path / "cache", 1 << 30,
                              plan=[[0], [1]], prefetch=1, concurrency=4)
            try:
                shards.get(0)
                assert shards.path(0).read_bytes() == (out / records[0]["shard"]).read_bytes()
                with pytest.raises(ShardCorrupt, match=records[1]["shard"]):
                    shards.get(1)
            finally:
                shards.close()
        gets = [(p, a.lower()) for (m, p), a in zip(proxy.seen, proxy.agents) if m == "GET" and "/shard-" in p]
        assert len(gets) >= 2 and all(client in a for _, a in gets), gets  # every shard GET from the client
    finally:
        server.stop()


def test_an_unknown_upload_client_is_one_line(monkeypatch, tmp_path):
    from vx.store import crt_s3

    monkeypatch.setenv("VX_S3_CLIENT", "curl")
    with pytest.raises(VxError, match="VX_S3_CLIENT='curl': use crt \\(the default\\) or boto3"):
        crt_s3.wanted()
