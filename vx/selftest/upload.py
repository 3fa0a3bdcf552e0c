"""`vx selftest --upload s3://...`: the S3 path on the user's own store, which no CI reaches (CI runs
moto over HTTP). The selftest's shards go to a fresh prefix under the URL through vx's uploader and
its default client (awscrt's, or boto3's with VX_S3_CLIENT=boto3), S3 checking each one's
full-object CRC64-NVME on receipt and a HEAD comparing it with the manifest; a 12 MiB probe goes up
as a multipart upload of three 5 MiB parts with its full-object checksum the same way (the
selftest's own shards may be under a part); every sample is read back by byte range and compared
with the local shard; everything written is deleted after.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PROBE_BYTES = 12 << 20  # three parts of S3's least part size (5 MiB)


def check_upload(report, out: Path, url: str, endpoint_url: str | None) -> None:
    """Adds the `upload` row; a failure goes to report.failures."""
    from vx.store.s3_client import make_client, parse_s3_url
    from vx.store import crt_s3
    from vx.store.format import MANIFEST
    from vx.store.remote_rows import RemoteRows, row_digest
    from vx.store.s3 import preflight
    from vx.store.uploader import Uploader

    base = parse_s3_url(url)
    target = parse_s3_url(f"{base}/vx-selftest-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")  # a prefix of its own
    preflight(target, endpoint_url)
    client = "awscrt" if crt_s3.wanted() else "boto3"
    try:
        up = Uploader(out, target, endpoint_url, keep_local=True, part_mb=5)
        summary = up.start().finish()
        probe = _multipart_probe(out.parent / "probe.bin", target, up)
        rows, bad = RemoteRows(str(target), endpoint_url), []
        records = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines() if line.strip()]
        from vx.store.reader import ShardFile

        samples = 0
        for rec in records:
            f = ShardFile(out / rec["shard"])
            offsets = f.tensor("offsets").tolist()
            for i in range(len(offsets) - 1):
                a, b = offsets[i], offsets[i + 1]
                local = {n: f.rows(n, a, b) for n in ("hidden_states", "hidden_scales", "input_ids") if n in f.entries}
                if rows.get(rec["shard"], a, b, row_digest(local)) is None:
                    bad.append(f"{rec['shard']} sample {i}")
                samples += 1
        if bad:
            report.failures.append(f"upload: {len(bad)} samples read back from {target} differ from the local "
                                   f"shard, first {bad[0]}")
        report.row("upload", f"{len(records)} shards ({summary['uploaded_bytes'] / 1e6:,.1f} MB) to {base} through "
                             f"{client} at {summary['upload_mb_s']:,.1f} MB/s, each checked by S3 on receipt "
                             f"(full-object CRC64-NVME) and by a HEAD; a {PROBE_BYTES >> 20} MiB multipart probe "
                             f"({probe}); {samples - len(bad)} of {samples} samples read back by byte range "
                             "equal the local shards; all deleted after")
    finally:  # everything under the selftest's own prefix
        s3 = make_client(endpoint_url)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=target.bucket, Prefix=target.key("")):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=target.bucket, Delete={"Objects": keys})


def _multipart_probe(path: Path, target, up) -> str:
    """A 12 MiB object sent as the uploader sends a shard (5 MiB parts), then its HEAD."""
    from vx.errors import VxError
    from vx.store import checksum

    path.write_bytes(os.urandom(PROBE_BYTES))
    try:
        rec = {"bytes": PROBE_BYTES, checksum.ALGO: checksum.file_crc64(path)}
        key = target.key("probe.bin")
        up.send(path, key, rec)
        head = checksum.head(up.client, target.bucket, key)
        if not checksum.head_ok(head, rec):
            raise VxError(f"{target}/probe.bin: the store's HEAD does not match what was sent (size or "
                          f"CRC64-NVME: {head.get(checksum.S3_FIELD)!r} against {rec[checksum.ALGO]!r})")
        return f"{PROBE_BYTES // (5 << 20) + 1} parts, S3's CRC64-NVME {head.get(checksum.S3_FIELD)} as sent"
    finally:
        path.unlink(missing_ok=True)
