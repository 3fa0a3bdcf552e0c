"""The S3 upload's cost to the driver: vx's uploader with the CRT client (the default) against the
boto3 transfer manager (VX_S3_CLIENT=boto3), to a moto server over HTTP in another process; and
the training loader's whole-shard downloads the same two ways.

For each client, the same committed shards (random bytes, 256 MB each, full-object CRC64-NVME as
the writer records it) go through `vx.store.uploader.Uploader` twice:
- alone: the uploader's MB/s (its own duration, what the run's summary reports) and the client
  process's CPU per GB (user and system, every thread; moto's process not counted);
- the kernel's own floor on this host: the same files sent with sendfile() to a socket sink in
  another process (what any client pays in system time to push the bytes over loopback);
- beside a timed loop on the main thread standing in for the driver's step loop (pure Python work,
  ~1 ms a step, which needs the GIL as the driver's does): its steps/s against the loop alone, and
  its slowest step;
- then downloaded back as the training loader's shard cache fetches them (whole objects in ranged
  GETs, 8 at a time: 64 MiB ones through the CRT, 8 MiB through boto3): MB/s and CPU per GB.

    python bench/upload.py [--gb 1] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import moto_server, write_result  # noqa: E402

SHARD = 256 << 20


def cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def shards(out: Path, total: int) -> None:
    """Committed shards and their manifest, as the writer leaves them."""
    from vx.store import checksum

    out.mkdir(parents=True)
    with open(out / "manifest.jsonl", "w") as m:
        for i in range(max(1, total // SHARD)):
            name = f"shard-{i:05d}.safetensors"
            (out / name).write_bytes(os.urandom(SHARD))
            m.write(json.dumps({"shard": name, "bytes": SHARD, checksum.ALGO: checksum.file_crc64(out / name),
                                "sample_ids": [f"s{i}"], "tokens": 1}) + "\n")


def step_loop(stop: threading.Event, steps: list[float]) -> None:
    """The driver's stand-in: ~1 ms of Python a step (dicts and lists, as bookkeeping is)."""
    while not stop.is_set():
        t = time.perf_counter()
        d = {}
        for i in range(2_000):
            d[i] = [i, str(i)]
        sum(len(v) for v in d.values())
        steps.append(time.perf_counter() - t)


def upload(out: Path, url: str, prefix: str, loop: bool) -> dict:
    from vx.store.s3_client import parse_s3_url
    from vx.store.uploader import Uploader

    up = Uploader(out, parse_s3_url(f"s3://vx-bench/{prefix}"), url, keep_local=True)
    stop, steps = threading.Event(), []
    u0, s0 = cpu()
    t = time.perf_counter()
    up.start()
    if loop:
        runner = threading.Thread(target=lambda: (up.finish(), stop.set()))
        runner.start()
        step_loop(stop, steps)
        runner.join()
        summary = {"uploaded_bytes": up.bytes, "upload_mb_s": up.bytes / up.seconds / 1e6}
    else:
        summary = up.finish()
    wall = time.perf_counter() - t
    u1, s1 = cpu()
    gb = summary["uploaded_bytes"] / 1e9
    res = {"gb": round(gb, 3), "upload_mb_s": round(summary["upload_mb_s"], 1), "wall_s": round(wall, 2)}
    if loop:
        res.update(steps_per_s=round(len(steps) / wall, 1), slowest_step_ms=round(1e3 * max(steps), 1))
    else:
        res.update(user_core_s_per_gb=round((u1 - u0) / gb, 3), sys_core_s_per_gb=round((s1 - s0) / gb, 3))
    return res


def send_floor(out: Path) -> dict:
    """The shards sent with sendfile() over loopback to a reader process: the system time any
    client pays for the bytes alone."""
    sink = subprocess.Popen([sys.executable, "-c", (
        "import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
        "print(s.getsockname()[1], flush=True)\nc, _ = s.accept(); b = bytearray(8 << 20)\n"
        "while c.recv_into(b): pass\n")], stdout=subprocess.PIPE, text=True)
    conn = socket.create_connection(("127.0.0.1", int(sink.stdout.readline())))
    files = sorted(out.glob("shard-*"))
    u0, s0 = cpu()
    t = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            conn.sendfile(fh)
    conn.close()
    wall = time.perf_counter() - t
    u1, s1 = cpu()
    sink.wait()
    gb = sum(f.stat().st_size for f in files) / 1e9
    return {"gb": round(gb, 3), "mb_s": round(gb * 1e3 / wall, 1), "user_core_s_per_gb": round((u1 - u0) / gb, 3),
            "sys_core_s_per_gb": round((s1 - s0) / gb, 3)}


def download(out: Path, url: str, prefix: str, client: str) -> dict:
    """The shards back from s3://vx-bench/prefix as vx/train/shard_cache.py fetches them."""
    from boto3.s3.transfer import TransferConfig

    from vx.store.s3_client import make_client
    from vx.store.crt_s3 import CrtS3
    from vx.train.shard_cache import FETCH_PART

    s3 = make_client(url)
    crt = CrtS3(s3, FETCH_PART, 8) if client == "crt" else None
    config = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=8)
    files = sorted(out.glob("shard-*"))
    dest = out.parent / "fetched"
    dest.mkdir(exist_ok=True)
    u0, s0 = cpu()
    t = time.perf_counter()
    for f in files:
        if crt is not None:
            crt.get("vx-bench", f"{prefix}/{f.name}", dest / f.name)
        else:
            s3.download_file("vx-bench", f"{prefix}/{f.name}", str(dest / f.name), Config=config)
    wall = time.perf_counter() - t
    u1, s1 = cpu()
    gb = sum(f.stat().st_size for f in files) / 1e9
    same = all((dest / f.name).read_bytes() == f.read_bytes() for f in files)
    for f in dest.iterdir():
        f.unlink()
    return {"gb": round(gb, 3), "mb_s": round(gb * 1e3 / wall, 1), "user_core_s_per_gb": round((u1 - u0) / gb, 3),
            "sys_core_s_per_gb": round((s1 - s0) / gb, 3), "bytes_equal": same}


def loop_alone(seconds: float) -> dict:
    stop, steps = threading.Event(), []
    threading.Timer(seconds, stop.set).start()
    t = time.perf_counter()
    step_loop(stop, steps)
    return {"steps_per_s": round(len(steps) / (time.perf_counter() - t), 1), "slowest_step_ms": round(1e3 * max(steps), 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import vx.store.uploader  # noqa: F401  (imports before anything is measured)

    root = Path(tempfile.mkdtemp(prefix="vx-upload-"))
    shards(root / "out", int(args.gb * 1e9))
    proc, url = moto_server()
    res: dict = {"shard_bytes": SHARD, "server": "moto over HTTP, its own process (not counted)", "runs": []}
    try:
        for rep in range(args.reps):  # interleaved, so that drift of the host's speed hits both alike
            row = {"loop_alone": loop_alone(5.0), "sendfile_floor": send_floor(root / "out")}
            for client in ("crt", "boto3"):
                os.environ["VX_S3_CLIENT"] = client
                row[client] = upload(root / "out", url, f"{client}-{rep}", loop=False)
                row[client + "_beside_loop"] = upload(root / "out", url, f"{client}-{rep}-loop", loop=True)
                row[client + "_beside_loop"]["loop_vs_alone"] = round(
                    row[client + "_beside_loop"]["steps_per_s"] / row["loop_alone"]["steps_per_s"], 3)
                row[client + "_download"] = download(root / "out", url, f"{client}-{rep}", client)
            print(json.dumps(row), flush=True)
            res["runs"].append(row)
    finally:
        proc.kill()
        proc.wait()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(write_result("upload", res, args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
