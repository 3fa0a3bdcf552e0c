"""The uploader sends shards through awscrt's S3 client (C threads, off the driver's GIL), or
through boto3's transfer manager with VX_S3_UPLOAD=boto3: either way a shard above the part size
goes as a multipart upload, S3 receives the manifest's full-object CRC64-NVME with it and checks
it, and the object holds the shard's bytes. A bad choice is one line. (The fault campaign fires
the upload's failpoints, multipart ones included, through the default client: test_fault_campaign.)"""

import json
import os

import pytest
from s3_faults import FaultyProxy, free_port
from test_s3 import CREDS, start_s3

from vx.errors import VxError
from vx.s3_client import parse_s3_url
from vx.store import checksum
from vx.store.uploader import Uploader

pytestmark = pytest.mark.xdist_group("s3-upload-client")


def committed(out, sizes):
    """Shards of random bytes and the manifest lines the writer would have committed for them."""
    out.mkdir()
    with open(out / "manifest.jsonl", "w") as m:
        for i, size in enumerate(sizes):
            name = f"shard-{i:05d}.safetensors"
            (out / name).write_bytes(os.urandom(size))
            m.write(json.dumps({"shard": name, "bytes": size, checksum.ALGO: checksum.file_crc64(out / name),
                                "sample_ids": [f"s{i}"], "tokens": 1}) + "\n")


@pytest.mark.parametrize("client,agent", [("crt", "crt"), ("boto3", "boto3")])
def test_a_shard_goes_up_multipart_with_its_full_object_checksum(tmp_path, monkeypatch, client, agent):
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VX_S3_UPLOAD", client)
    port = free_port()
    server, _, s3 = start_s3(port)
    try:
        out = tmp_path / "out"
        committed(out, [12 << 20, 1 << 20])  # three 5 MiB parts, then one request
        with FaultyProxy(port) as proxy:
            summary = Uploader(out, parse_s3_url(f"s3://vx-out/{client}"), proxy.url, part_mb=5).start().finish()
        assert summary["uploaded_bytes"] == 13 << 20 and summary["upload_mb_s"] > 0
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
            assert body == (out / rec["shard"]).read_bytes() if (out / rec["shard"]).exists() else len(body) == rec["bytes"]
        assert not s3.list_multipart_uploads(Bucket="vx-out").get("Uploads")
    finally:
        server.stop()


def test_an_unknown_upload_client_is_one_line(monkeypatch, tmp_path):
    from vx.store import crt_put

    monkeypatch.setenv("VX_S3_UPLOAD", "curl")
    with pytest.raises(VxError, match="VX_S3_UPLOAD='curl': use crt \\(the default\\) or boto3"):
        crt_put.wanted()
