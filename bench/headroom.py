"""Host headroom: what vx's own worker-side path costs per GB of states, with no model.

Synthetic captured rows (a 27B-shaped target: 5 layers x 5120, 512-token samples, 8,192-token
steps) go through vx's GPU capture path as the engine's worker runs it, the CPU standing in for
the GPU: the main thread does the device's share (gather, token flags, encoding, the copy into a
slot of the ring capture_budget sizes), and the host's share runs as on a GPU node (the intake
thread checks the flags and hands views of the ring's slots to the shard writer, which packs,
checksums, writes, fsyncs and commits from the ring). Locally (tmpfs and the disk, beside a raw
sequential write of the same bytes) and to S3 (vx's uploader to a moto server over HTTP in
another process, whose CPU is not counted). For each: GB/s of states through one process (GB of
bf16 states, what the GPU produced; fp8 writes about half; bounded here by the CPU doing the
GPU's share), and the host's CPU per GB (every thread but the main one): user (vx's own work)
apart from system (the write and fsync system calls, the page cache copy); locally also with the
states coded in row blocks (--compress blocks: its threads' CPU counted). Beside them, what one GPU needs at its compute limit for a
Qwen3.6-27B and a Qwen3.5-4B-class target, and the host cores 8 such GPUs need.

    python bench/headroom.py [--gb 2] [--dir /path/on/the/output/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

LAYERS, HIDDEN, TOKENS = 5, 5120, 512
# bf16 dense tensor peaks (vendor datasheets): H200 SXM 989 TFLOPS; RTX PRO 6000 Blackwell ~504 TFLOPS
PEAKS = {"H200": 989e12, "RTX PRO 6000": 504e12}
# (active params, hidden, captured layers): prefill costs ~2 x params FLOPs per token
TARGETS = {"Qwen3.6-27B": (27e9, 5120, 5), "Qwen3.5-4B-class": (4e9, 2560, 5)}
MFU = 0.8  # a good prefill MFU; at 100% the needs are 1.25x these


def cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process's threads other than the calling one: the
    host's share of the capture (the intake, the shard writer, the uploader), without the main
    thread, which stands in for the GPU (the gather, flags, encoding and copy into the ring)."""
    r, me = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime - me.ru_utime, r.ru_stime - me.ru_stime


def measured(fn):
    u0, s0 = cpu()
    t = time.perf_counter()
    nbytes = fn()
    wall = time.perf_counter() - t
    u1, s1 = cpu()
    gb = nbytes / 1e9
    return {"gb": round(gb, 3), "wall_s": round(wall, 3), "gb_s": round(gb / wall, 3),
            "user_core_s_per_gb": round((u1 - u0) / gb, 4), "sys_core_s_per_gb": round((s1 - s0) / gb, 4)}


def raw_write(path: Path, total: int, chunk: int = 8 << 20) -> int:
    """A sequential write of the same bytes from a helper thread (so cpu() counts it too)."""
    import threading

    buf = os.urandom(chunk)

    def write():
        with open(path, "wb") as f:
            for _ in range(total // chunk):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())

    t = threading.Thread(target=write)
    t.start()
    t.join()
    path.unlink()
    return total // chunk * chunk


STEP = 8192  # tokens per engine step: vx's GPU default


def step_cache(dtype: str):
    """A hidden-state cache as vLLM lays it ([blocks, L, block_size, H] bf16) holding one full
    step of 512-token samples, and the Finished records that point at them."""
    import torch

    from vx.engine.capture import Finished

    bs, n = 16, STEP // TOKENS
    g = torch.Generator().manual_seed(0)
    cache = (torch.randn(n * TOKENS // bs, LAYERS, bs, HIDDEN, generator=g) * 3).to(torch.bfloat16)
    per = TOKENS // bs
    return cache, bs, [Finished(f"r{i}", f"s{i}", None, bytes([1]) * TOKENS, list(range(TOKENS)),
                                list(range(i * per, (i + 1) * per))) for i in range(n)]


def writer_run(out: Path, total: int, dtype: str, shard_mb: int, uploader=None, compress: str | None = None) -> int:
    """vx's GPU capture path with the CPU in the GPU's place: the main thread submits a full
    step of finished requests at a time to a CaptureSink staging through its ring (gather,
    flags, encoding, copy into a slot), as the forward does; the intake thread checks the flags
    and hands views of the slots to the ShardWriter, whose thread packs, checksums, writes,
    fsyncs and commits from the ring, then releases the slots. Ring and chunk sizes are those
    capture_budget gives a 27B target. Returns the bf16 states bytes this stands for."""
    import dataclasses

    import torch

    from vx.engine.capture import capture_budget
    from vx.engine.sink import CaptureSink
    from vx.store.writer import ShardWriter

    cache, bs, finished = step_cache(dtype)
    budget = capture_budget(STEP, LAYERS, HIDDEN, dtype, shard_bytes=shard_mb << 20)
    writer = ShardWriter(out, {"model": "bench"}, shard_mb << 20, 0, LAYERS, HIDDEN, dtype, compress=compress)
    sink = CaptureSink(writer, dtype, torch.device("cpu"), staging="ring", **budget)
    step_bytes = STEP * LAYERS * HIDDEN * 2
    steps = max(1, total // step_bytes)
    for k in range(steps):
        sink.submit(cache, [dataclasses.replace(f, sample_id=f"{k}-{f.sample_id}") for f in finished], bs)
    sink.close()
    if writer.rejected:
        raise RuntimeError(f"the synthetic states failed vx's checks: {writer.rejected[0]}")
    if uploader is not None:
        uploader.finish()
    _LAST.update(zero_copy_rows=sink.zero_copy_rows, copied_rows=sink.copied_rows, ring_waits=sink.ring_waits,
                 stored_over_raw=round(writer.committed_bytes / max(1, writer.added_bytes), 4))
    return steps * step_bytes


_LAST: dict = {}


def s3_run(root: Path, total: int, dtype: str, shard_mb: int) -> dict:
    from common import moto_server
    from vx.store.s3_client import parse_s3_url
    from vx.store.uploader import Uploader

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    server, url = moto_server()
    try:
        out = root / f"s3-{dtype}"
        out.mkdir()
        up = Uploader(out, parse_s3_url("s3://vx-bench/run"), url).start()
        return dict(measured(lambda: writer_run(out, total, dtype, shard_mb, up)), **_LAST)
    finally:
        server.kill()
        server.wait()


def checksum_rates() -> dict:
    import hashlib

    from awscrt import checksums

    buf = os.urandom(256 << 20)
    res = {}
    for name, fn in (("crc64nvme", lambda: checksums.crc64nvme(buf)), ("sha256", lambda: hashlib.sha256(buf))):
        best = min(_timed(fn) for _ in range(3))
        res[f"{name}_gb_s_one_core"] = round(len(buf) / best / 1e9, 2)
    return res


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def needs(core_s_per_gb: float) -> dict:
    out = {}
    for gpu, peak in PEAKS.items():
        for name, (params, hidden, layers) in TARGETS.items():
            tok_s = peak * MFU / (2 * params)
            gb_s = tok_s * layers * hidden * 2 / 1e9
            out[f"{name} on {gpu}"] = {"states_gb_s_per_gpu": round(gb_s, 2),
                                       "host_cores_for_8_gpus": round(8 * gb_s * core_s_per_gb, 2)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="states fed per measurement")
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--dir", default=None, help="a folder on the output disk (default: a temp dir)")
    args = ap.parse_args(argv)
    total = int(args.gb * 1e9)
    res = {"checksum": checksum_rates(), "shape": {"layers": LAYERS, "hidden": HIDDEN, "tokens_per_sample": TOKENS},
           "runs": {}}
    places = {"disk": Path(tempfile.mkdtemp(prefix="vx-headroom-", dir=args.dir))}
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 3 * total:
        places["tmpfs"] = Path(tempfile.mkdtemp(prefix="vx-headroom-", dir="/dev/shm"))
    import torch

    torch.set_num_threads(1)  # the GPU's stand-in runs on the main thread alone: an OpenMP team's
    # threads would be counted as the host's
    import vx.engine.sink  # noqa: F401  (the imports, before anything is measured)
    import vx.store.uploader  # noqa: F401
    try:
        for where, root in places.items():
            res["runs"][f"raw_write_{where}"] = measured(lambda: raw_write(root / "raw.bin", total))
            for dtype in ("bf16", "fp8"):
                for compress in (None, "blocks"):  # each codec's core-s per GB (the coding threads counted)
                    out = root / f"{where}-{dtype}"
                    out.mkdir()
                    res["runs"][f"vx_{dtype}_{where}" + (f"_{compress}" if compress else "")] = dict(
                        measured(lambda: writer_run(out, total, dtype, args.shard_mb, compress=compress)), **_LAST)
                    shutil.rmtree(out)
        for dtype in ("bf16", "fp8"):
            res["runs"][f"vx_{dtype}_s3_moto_http"] = s3_run(places["disk"], total, dtype, args.shard_mb)
    finally:
        for root in places.values():
            shutil.rmtree(root, ignore_errors=True)
    local = max(r["user_core_s_per_gb"] for k, r in res["runs"].items()
                if k.startswith("vx_bf16") and "s3" not in k and "blocks" not in k)
    s3 = res["runs"]["vx_bf16_s3_moto_http"]["user_core_s_per_gb"]
    res["goal_user_core_s_per_gb_bf16"] = 0.3
    res["vx_bf16_local_user_core_s_per_gb"] = local
    res["vx_bf16_s3_user_core_s_per_gb"] = s3  # boto3's HTTP client included
    res["gpu_needs_at_mfu"] = MFU
    res["gpu_needs_local"] = needs(local)
    res["gpu_needs_s3"] = needs(s3)
    print(json.dumps(res, indent=1))
    from common import write_result

    print(f"wrote {write_result('headroom', res)}", file=sys.stderr)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
