"""Output path throughput: vx's shard writer and an S3 upload (local moto server over HTTP)
against a raw sequential write with fsync on the same disk, in one run.

    python bench/sink.py [--mb 512] [--dir /path/on/the/output/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path


def raw_write(path: Path, total: int, chunk: int = 8 << 20) -> float:
    """Like `dd bs=8M conv=fsync`: sequential writes of a buffer, then fsync."""
    buf = os.urandom(chunk)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def shard_write(out: Path, total: int, shard_mb: int) -> tuple[float, int]:
    import torch

    from vx.store.writer import ShardWriter

    layers, hidden, tokens = 5, 5120, 512  # one sample = 512 tokens of a 27B-shaped target
    sample = torch.randn(tokens, layers, hidden).to(torch.bfloat16)
    per = sample.numel() * 2
    writer = ShardWriter(out, {"model": "bench"}, shard_mb << 20, 0, layers, hidden, "bf16")
    ids, mask = list(range(tokens)), [1] * tokens
    t = time.perf_counter()
    for i in range(max(1, total // per)):
        writer.add(str(i), ids, mask, sample)
    writer.close()
    return time.perf_counter() - t, writer.committed_bytes


def s3_upload(files: list[Path]) -> tuple[float, int]:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket="vx-bench")
        cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)
        t = time.perf_counter()
        for f in files:
            s3.upload_file(str(f), "vx-bench", f"run/{f.name}", Config=cfg)
        wall = time.perf_counter() - t
        return wall, sum(f.stat().st_size for f in files)
    finally:
        server.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--shard-mb", type=int, default=128)
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=3, help="raw and writer runs, interleaved; medians")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="vx-sink-", dir=args.dir))
    total = args.mb << 20
    raws, writes = [], []
    try:
        for rep in range(args.reps):
            raws.append(raw_write(root / "raw.bin", total))
            (root / "raw.bin").unlink()
            shards = root / f"shards-{rep}"
            shards.mkdir()
            writes.append(shard_write(shards, total, args.shard_mb))
            if rep < args.reps - 1:
                shutil.rmtree(shards)
        s3_s, s3_bytes = s3_upload(sorted(shards.glob("shard-*.safetensors")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw_s = statistics.median(raws)
    shard_s, shard_bytes = sorted(writes)[len(writes) // 2]
    raw = total / raw_s / 1e6
    res = {"mb": args.mb, "raw_write_fsync_mb_s": round(raw, 1),
           "shard_writer_mb_s": round(shard_bytes / shard_s / 1e6, 1),
           "s3_upload_local_moto_mb_s": round(s3_bytes / s3_s / 1e6, 1)}
    res["writer_over_raw"] = round(res["shard_writer_mb_s"] / raw, 3)
    res["s3_over_raw"] = round(res["s3_upload_local_moto_mb_s"] / raw, 3)
    print(json.dumps(res))
    from common import write_result

    print(f"wrote {write_result('sink', res)}", file=sys.stderr)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
