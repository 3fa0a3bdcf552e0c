"""Lossless codecs for stored states, by measurement: ratio, encode and decode GB/s on one core.

    python bench/codec.py [--mb 64] [--block-kib 1024] [--samples 64]

Each of vx's codecs (vx/store/codec.py, as `vx inspect --codecs` runs them) codes ~1 MiB blocks of
rows independently (what keeps a sample's byte range readable), on one thread; speeds are GB/s of the uncoded bytes, best of --reps passes; every block is decoded
and compared with its input byte for byte (a codec that is not lossless fails the run).

Data, each in bf16 and in fp8 e4m3 with one scale per token and layer (vx's fp8 storage):
  bench-model  states of the bench model (8 layers, hidden 256, the real Qwen3.6 vocabulary, random
               weights) on real chat samples, through vx's HF backend: layers [1, 3, 5, 7]
  outliers     synthetic [T, 5, 5120] residual streams with the structure the "massive activations"
               literature reports (Sun et al. 2024; Dettmers et al. 2022, LLM.int8()): per-channel
               scales log-normal (sigma 0.6) growing 2x per captured layer; 6 fixed outlier channels
               at 20-100x the median on every token; on the first token and ~2% of the rest
               (delimiters), 2 fixed channels at 1,000-10,000x the median. Seeded (synthetic_states).
Also, per bf16 codec, the share of its Python speed a main thread keeps while another thread
codes (gil_share): a codec that holds the GIL slows the thread beside it, which in vLLM's worker is
the forward's (vx's writer runs in that process). 2 cores: a codec that releases it leaves ~100%.
Writes bench/results/codec-<device>-<date>-<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_result  # noqa: E402

from vx.store import codec as vx_codec  # noqa: E402


def synthetic_states(tokens: int, layers: int = 5, hidden: int = 5120, seed: int = 0):
    """[T, L, H] float32 residual streams with outlier channels and massive activations."""
    rng = np.random.default_rng(seed)
    chan = rng.lognormal(0.0, 0.6, size=(layers, hidden)).astype(np.float32)  # [L, H]
    chan *= (2.0 ** np.arange(layers, dtype=np.float32))[:, None]  # deeper layers: larger stream
    outliers = rng.choice(hidden, 8, replace=False)
    chan[:, outliers[:6]] *= rng.uniform(20, 100, size=6).astype(np.float32)
    x = rng.standard_normal((tokens, layers, hidden), dtype=np.float32) * chan  # [T, L, H]
    massive = np.zeros(tokens, dtype=bool)
    massive[0] = True
    massive |= rng.random(tokens) < 0.02
    median = np.median(np.abs(x[:256]), axis=(0, 2))  # [L]
    for c in outliers[6:]:
        x[massive, :, c] = median * rng.uniform(1e3, 1e4, size=(int(massive.sum()), layers)).astype(np.float32)
    return x


def model_states(samples: int):
    """[T, L, H] float32 states of the bench model on real chat samples (vx's HF backend)."""
    import torch

    from common import bench_model, real_samples
    from vx.data.model import load_tokenizer
    from vx.engine.hf_extractor import HFExtractor, load_hf_model

    model_dir = bench_model(8)
    model = load_hf_model(model_dir, "float32", "cpu")
    ex = HFExtractor(model, [1, 3, 5, 7])
    with torch.inference_mode():
        rows = [ex.extract([s])[0].float() for s in real_samples(load_tokenizer(model_dir), samples)]
    return torch.cat(rows).numpy()


def bf16_bytes(x) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.uint8).numpy().reshape(-1)


def fp8_bytes(x) -> np.ndarray:
    """vx's fp8 storage: e4m3 with one scale per token and layer (max |x| -> 448); the values only."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x))
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(-1)


def threaded_encode(data: np.ndarray, block: int, threads: int, reps: int) -> float:
    """GB/s of vx's block codec coding every block on `threads` threads, as the shard writer does."""
    from concurrent.futures import ThreadPoolExecutor

    ours = vx_codec.BlockCodec(2)
    blocks = [[data[i:i + block]] for i in range(0, data.size, block)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(ours.encode, blocks))
            best = min(best, time.perf_counter() - t)
    return data.size / best / 1e9


def _ticks(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def gil_share(data: np.ndarray, block: int, enc, seconds: float = 2.0) -> float:
    """Python loop speed of this thread while another thread codes blocks, over its speed alone."""
    import threading

    blocks = [data[i:i + block].tobytes() for i in range(0, min(data.size, 64 * block), block)]
    stop = threading.Event()

    def code():
        while not stop.is_set():
            for b in blocks:
                enc(b)
                if stop.is_set():
                    return

    alone = _ticks(seconds)
    t = threading.Thread(target=code)
    t.start()
    time.sleep(0.2)
    beside = _ticks(seconds)
    stop.set()
    t.join()
    return beside / alone


def measure(data: np.ndarray, block: int, reps: int, itemsize: int) -> dict:
    """vx's own codecs (vx/store/codec.py, what `vx inspect --codecs` runs), best of reps; a codec
    that is not lossless fails the run."""
    blocks, best = [data[i:i + block].tobytes() for i in range(0, data.size, block)], {}
    for _ in range(reps):
        for r in vx_codec.measure(blocks, itemsize):
            if not r["lossless"]:
                raise SystemExit(f"{r['codec']} is not lossless")
            b = best.setdefault(r.pop("codec"), r)
            b.update(encode_gb_s=max(b["encode_gb_s"], r["encode_gb_s"]), decode_gb_s=max(b["decode_gb_s"], r["decode_gb_s"]))
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="MB of bf16 states per synthetic data set")
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=64, help="real chat samples through the bench model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    sets = {"outliers": synthetic_states(args.mb * (1 << 20) // (2 * 5 * 5120))}
    if args.samples:
        sets["bench-model"] = model_states(args.samples)
    block = args.block_kib << 10
    table = {}
    for name, x in sets.items():
        for dtype, data in (("bf16", bf16_bytes(x)), ("fp8", fp8_bytes(x))):
            itemsize = 2 if dtype == "bf16" else 1
            for codec, r in measure(data, block, args.reps, itemsize).items():
                if dtype == "bf16" and name == "outliers":
                    r["gil_share"] = gil_share(data, block, vx_codec.codecs(itemsize)[codec][0])
                if codec == "planes":
                    r["encode_gb_s_2_threads"] = threaded_encode(data, block, 2, args.reps)
                table[f"{name}/{dtype}/{codec}"] = dict(r, mb=data.size / 1e6)
                print(f"{name:12s} {dtype:5s} {codec:22s} ratio {r['ratio']:.3f}  encode {r['encode_gb_s']:.2f} GB/s"
                      f"  decode {r['decode_gb_s']:.2f} GB/s"
                      + (f"  main thread beside it {r['gil_share']:.0%}" if "gil_share" in r else "")
                      + (f"  2 threads encode {r['encode_gb_s_2_threads']:.2f} GB/s"
                         if "encode_gb_s_2_threads" in r else ""), flush=True)
    result = {"device": f"cpu-{platform.machine()}", "cpu": platform.processor(), "block_bytes": block,
              "threads": 1, "results": table}
    print(f"wrote {write_result('codec', result, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
