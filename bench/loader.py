"""vx.loader throughput and memory, in one run:

  local: an epoch of packed batches vs a raw sequential read of the same shard files (warm page
         cache for both: the loader's own cost; the loader after one warm-up epoch, as training
         runs it: its batch buffers are allocated once), tokens/s and GB/s;
  S3:    an epoch from a moto S3 server on loopback (bounded cache, prefetch) vs a plain boto3
         download_file of the same objects;
  RSS:   peak resident memory of an epoch over a dataset and over one 10x larger (subprocesses).

The datasets are synthetic vx outputs written by vx's own ShardWriter (random bf16 states), so
the bench needs neither a model nor ../shared.

    python bench/loader.py [--mb 400] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYERS = 5
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def write_output(out: Path, target_bytes: int, hidden: int, seed: int = 0, mean_tokens: int = 335) -> dict:
    """A vx output of random bf16 states, ~target_bytes of hidden states, 64 MB shards."""
    from vx.store.output import prepare_output
    from vx.store.writer import ShardWriter

    meta = {"format": "vx-1", "model": "synthetic", "model_fingerprint": "bench", "layer_ids": list(range(LAYERS)),
            "hidden_size": hidden, "store_dtype": "bf16"}
    state = prepare_output(out, meta, overwrite=True)
    w = ShardWriter(out, {"model": "synthetic"}, 64 << 20, state.next_shard, LAYERS, hidden, "bf16")
    g = torch.Generator().manual_seed(seed)
    per_token, total, n = LAYERS * hidden * 2, 0, 0
    block = torch.randn(4096, LAYERS, hidden, generator=g).to(torch.bfloat16)  # reused: writing is not timed
    while total < target_bytes:
        t = int(torch.randint(16, 2 * mean_tokens, (1,), generator=g))
        w.add(f"s{n}", list(range(t)), [1] * t, block[:t] if t <= 4096 else torch.zeros(t, LAYERS, hidden))
        total += t * per_token
        n += 1
    w.close()
    return {"samples": n, "bytes": total}


def epoch(path_or_loader, **kw) -> tuple[int, float]:
    """One epoch; pass a Loader to time it as training runs it (its batch buffers already warm)."""
    import vx

    data = vx.loader(path_or_loader, 16384, seed=0, **kw) if isinstance(path_or_loader, str) else path_or_loader
    t, tokens = time.perf_counter(), 0
    for b in data:
        tokens += int(b["cu_seqlens"][-1])
    return tokens, time.perf_counter() - t


def raw_read(files: list[Path]) -> float:
    t = time.perf_counter()
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t


def rss_child(path: str) -> None:
    tokens, s = epoch(path)
    # VmHWM is this process image's peak (ru_maxrss would carry the forking parent's over exec)
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"tokens": tokens, "s": s, "peak_rss_mb": round(hwm / 1024, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=400, help="hidden-state MB of the throughput dataset")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="vx-bench-loader-") as tmp:
        tmp = Path(tmp)
        info = write_output(tmp / "d", int(args.mb * 1e6), args.hidden)
        files = sorted((tmp / "d").glob("shard-*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        raw_read(files)  # warm the page cache
        best = {"loader": 1e9, "raw": 1e9}
        import vx

        data = vx.loader(str(tmp / "d"), 16384, seed=0)
        epoch(data)  # warm: the loader's batch buffers are allocated once per run
        for rep in range(args.reps):
            data.set_epoch(rep + 1)
            tokens, s = epoch(data)
            best["loader"] = min(best["loader"], s)
            best["raw"] = min(best["raw"], raw_read(files))
        results["local"] = {"samples": info["samples"], "tokens": tokens, "bytes": nbytes,
                            "loader_tokens_per_s": round(tokens / best["loader"]),
                            "loader_gb_s": round(nbytes / best["loader"] / 1e9, 3),
                            "raw_gb_s": round(nbytes / best["raw"] / 1e9, 3),
                            "ratio": round(best["raw"] / best["loader"], 3)}
        results["s3"] = bench_s3(tmp, files, nbytes)
        results["rss"] = bench_rss(tmp, args.hidden)
    print(json.dumps(results, indent=2))
    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_result

    print(f"wrote {write_result('loader', results)}", file=sys.stderr)


def bench_s3(tmp: Path, files: list[Path], nbytes: int) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    sys.path.insert(0, str(ROOT / "tests"))
    from s3_faults import free_port

    os.environ.update(CREDS)
    port = free_port()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        for f in sorted((tmp / "d").iterdir()):
            if f.is_file() and not f.name.startswith("."):
                client.upload_file(str(f), "bench", f"d/{f.name}")
        t = time.perf_counter()
        for f in files:
            client.download_file("bench", f"d/{f.name}", str(tmp / "plain.bin"))
        plain = time.perf_counter() - t
        tokens, s = epoch("s3://bench/d", endpoint_url=url, cache_dir=str(tmp / "cache"), cache_gb=4 * 64e6 / 1e9)
        return {"bytes": nbytes, "loader_gb_s": round(nbytes / s / 1e9, 3), "loader_tokens_per_s": round(tokens / s),
                "boto3_download_gb_s": round(nbytes / plain / 1e9, 3), "ratio": round(plain / s, 3),
                "cache_gb": 0.256}
    finally:
        server.stop()


def bench_rss(tmp: Path, hidden: int) -> dict:
    out = {}
    for scale, mb in (("1x", 60), ("10x", 600)):
        info = write_output(tmp / f"rss-{scale}", int(mb * 1e6), 64, seed=1, mean_tokens=100)
        r = subprocess.run([sys.executable, __file__, "--rss-child", str(tmp / f"rss-{scale}")],
                           capture_output=True, text=True, check=True)
        out[scale] = dict(json.loads(r.stdout), samples=info["samples"], mb=mb)
    out["growth"] = round(out["10x"]["peak_rss_mb"] / out["1x"]["peak_rss_mb"], 3)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rss-child":
        rss_child(sys.argv[2])
    else:
        main()
