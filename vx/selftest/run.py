"""`vx selftest`: proof, on this machine, that this install captures the right states, fast.

1. The vLLM contract check (vx/engine/contract.py) and the tensor-parallel page check.
2. A small random model of the target's architecture: the target's own config with a few layers
   (every layer type kept) and its real hidden size and vocabulary, random bf16 weights, built
   once into the vx cache; the embedded tiny model without --model.
3. A synthetic length mix that exercises what breaks batched capture: 1-token samples, samples
   longer than a step (chunked prefill), samples sharing a long prefix, identical samples.
4. vx's real path (vLLM engine, capture connector, ShardWriter; compiled with CUDA graphs on a
   GPU) over every layer of the model, then every sample against the HF reference on the same
   device (fp32 when it fits): per layer the worst cosine and max |diff|.
5. Bare vLLM prefill of the same data on the same engine settings: tokens/s, vx's ratio, MFU
   where the device's peak is known.
6. Backpressure and fp8, on the same engine: the samples again, stored fp8, through a ring cut to
   the copies in flight with the writer started only once the forward has waited for space (a
   slow disk or S3, compressed in time), coded in row blocks (--compress blocks), every sample
   against the reference under fp8's bound.
7. The one-pass mode (vx extract --regenerate) on a few conversations, sampled: its stored ids
   against the template's rendering of what it regenerated, its states against the HF reference
   (vx/selftest/one_pass.py).
One table on stdout; exit 0, or 1 naming the first sample and layer outside the bound.
Over 300 lines: one command's stages in the order the table shows them, read top to bottom.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vx.data.samples import Sample
from vx.engine import patches
from vx.engine.plan_start import describe_target
from vx.errors import VxError

WRITER_HOLD_S = 60.0  # the backpressure stage's writer starts once the ring is full, at most this late
CPU_STEP_TOKENS = 512  # on CPU a small step, so that short samples are chunked too


@dataclass
class SelftestConfig:
    model: str | None = None
    tensor_parallel_size: int = 1
    samples: int | None = None         # None: 40 on CPU, 128 on a GPU
    bench: bool = True                 # also time bare vLLM prefill on the same data
    one_pass: bool = True              # also run vx extract --regenerate and check what it stored
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None  # None: vx's default (compiled + CUDA graphs on a GPU)
    output: Path | None = None         # keep shards and logs here (default: a temp dir, removed)
    upload: str | None = None          # also prove the S3 path: s3://bucket/prefix (vx/selftest/upload.py)
    endpoint_url: str | None = None
    seed: int = 0

    def __post_init__(self):
        from vx.errors import UsageError

        if self.tensor_parallel_size < 1:
            raise UsageError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.samples is not None and self.samples < 12:
            raise UsageError(f"--samples must be >= 12 (the mix needs its special cases), got {self.samples}")
        if self.upload is not None:
            from vx.store.s3_client import parse_s3_url

            parse_s3_url(self.upload)  # one line for a bad URL, before any engine starts


@dataclass
class SelftestReport:
    lines: list[tuple[str, str]] = field(default_factory=list)  # (label, text) rows of the table
    layers: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    def row(self, label: str, text: str) -> None:
        self.lines.append((label, text))

    @property
    def ok(self) -> bool:
        return not self.failures


def length_mix(n: int, step: int, vocab: int, seed: int = 0) -> list[Sample]:
    """n samples: two of 1 token, one of 2, two longer than a step (chunked over 2 and 3 steps),
    four sharing a prefix of a quarter step, two identical, the rest log-uniform up to half a step."""
    rng = random.Random(seed)

    def ids(k):
        return [rng.randrange(vocab) for _ in range(k)]

    seqs = [ids(1), ids(1), ids(2), ids(step + 37), ids(2 * step + 5)]
    prefix = ids(max(8, step // 4))
    seqs += [prefix + ids(rng.randint(1, 64)) for _ in range(4)]
    twin = ids(rng.randint(8, max(9, step // 2)))
    seqs += [twin, list(twin)]
    while len(seqs) < n:
        seqs.append(ids(int(round(4 * (max(5, step // 2) / 4) ** rng.random()))))
    kinds = ["1-token", "1-token", "2-token", "chunked", "chunked"] + ["shared-prefix"] * 4 + ["identical"] * 2
    return [Sample(f"{kinds[i] if i < len(kinds) else 'mix'}-{i:03d}", i + 1, s, [1] * len(s))
            for i, s in enumerate(seqs)]


def run_selftest(cfg: SelftestConfig) -> SelftestReport:
    import importlib.util

    from vx.device import cuda_available
    from vx.errors import UsageError

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vx selftest checks vx's vLLM path and needs vLLM: pip install 'vx[gpu]' (GPU) or "
                         "'vx[cpu]' (CPU)")
    report = SelftestReport()
    on_gpu = cuda_available()  # NVML: nothing initialises CUDA before the engines have started
    work = Path(cfg.output) if cfg.output else Path(tempfile.mkdtemp(prefix="vx-selftest-"))
    try:
        _run(cfg, report, on_gpu, work)
    finally:
        if cfg.output is None:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _run(cfg: SelftestConfig, report: SelftestReport, on_gpu: bool, work: Path) -> None:
    import vllm

    from vx.data.model import model_info, resolve_model
    from vx.data.tiny import small_random_twin
    from vx.engine.defaults import MAX_NUM_BATCHED_TOKENS

    t0 = time.perf_counter()
    model_dir = resolve_model(cfg.model) if cfg.model is None else small_random_twin(resolve_model(cfg.model))
    info = model_info(model_dir)
    layers = list(range(info.num_layers))
    step = cfg.max_num_batched_tokens or (MAX_NUM_BATCHED_TOKENS if on_gpu else CPU_STEP_TOKENS)
    if info.max_position_embeddings:  # the chunked samples (2 steps + 5 tokens) must fit the model
        step = max(16, min(step, (info.max_position_embeddings - 8) // 2))
    samples = length_mix(cfg.samples or (128 if on_gpu else 40), step, info.vocab_size, cfg.seed)
    tokens = sum(len(s) for s in samples)
    from vx.engine.defaults import check_tensor_parallel_pages

    pages = check_tensor_parallel_pages(model_dir, cfg.tensor_parallel_size, info.num_layers)  # one line if exposed
    report.row("vLLM", f"{vllm.__version__}; vx's contract is checked as the engine starts (method, connector API, "
                       "hidden-state cache, aux-output interface)" + (
                           f"; TP {pages['tensor_parallel_size']} page {pages['page_bytes']:,} B vs "
                           f"{pages['state_bytes_per_token']:,} B of states per token"
                           + (" (vLLM scales the pages)" if pages["exposed"] else "") if pages else ""))
    report.row("model", f"{info.model_type}{' (VL layout, text-only)' if info.vision_language else ''}, {info.num_layers} layers of hidden {info.hidden_size}, vocab "
                        f"{info.vocab_size:,}, random bf16 weights" + (f" (the config of {cfg.model})" if cfg.model
                                                                       else " (the embedded default)")
               + f", built in {time.perf_counter() - t0:.1f}s")
    report.row("data", f"{len(samples)} samples, {tokens:,} tokens: 2 of 1 token, 2 over the {step:,}-token step "
                       "(chunked), 4 with a shared prefix, 2 identical")
    common = dict(max_model_len=max(len(s) for s in samples) + 2, max_num_batched_tokens=step,
                  tensor_parallel_size=cfg.tensor_parallel_size, enforce_eager=cfg.enforce_eager,
                  vision_language=info.vision_language)
    out = work / "out"
    vx_s, engine, stressed = _run_vx(model_dir, layers, samples, info, out, common, work / "backpressure")
    report.row("engine", engine)
    if cfg.model:  # the real target's capture engine, planned by vLLM's functions from its config
        report.row("target plan", describe_target(cfg.model, cfg.tensor_parallel_size, not on_gpu))
    bare_s = _run_bare(model_dir, samples, work, common) if cfg.bench else None
    _compare(report, out, work / "backpressure", stressed, samples, model_dir, info)
    if cfg.upload:
        from vx.selftest.upload import check_upload

        check_upload(report, out, cfg.upload, cfg.endpoint_url)
    if cfg.one_pass:
        from vx.selftest.one_pass import check_one_pass

        check_one_pass(report, cfg, model_dir, info, work, on_gpu)
    from vx.monitor.flops import flops_per_token
    from vx.monitor.peak import peak_flops

    flops = flops_per_token(model_dir) * tokens
    peak, peak_what = peak_flops(cfg.tensor_parallel_size) if on_gpu else (None, "")
    speed = f"vx {tokens / vx_s:,.0f} tokens/s" + (f" (MFU {flops / vx_s / peak:.1%})" if peak else "")
    if bare_s:
        speed = f"bare vLLM prefill {tokens / bare_s:,.0f} tokens/s" + \
            (f" (MFU {flops / bare_s / peak:.1%})" if peak else "") + f"; {speed}; vx/bare {bare_s / vx_s:.3f}x"
    report.row("throughput", speed + (f" (peak: {peak_what})" if peak else
                                      f"; MFU: {peak_what or 'shown on GPUs (on CPU: vx extract measures the peak)'}"))
    report.result.update(vx_tokens_per_s=tokens / vx_s, bare_tokens_per_s=tokens / bare_s if bare_s else None,
                         ratio=bare_s / vx_s if bare_s else None, tokens=tokens, samples=len(samples),
                         total_s=time.perf_counter() - t0)


def _run_vx(model_dir, layers, samples, info, out: Path, common: dict,
            stress_out: Path) -> tuple[float, str, dict]:
    import numpy as np

    from vx.engine.vllm_extractor import VllmExtractor

    out.mkdir(parents=True, exist_ok=True)
    ex = VllmExtractor(model_dir, layers, log_file=out / "logs" / "vllm.log",
                       sample_lengths=np.array([len(s) for s in samples]), **common)  # max_num_seqs from them
    try:
        config = ex.engine.vllm_config
        runner = "Model Runner V2" if getattr(config, "use_v2_model_runner", False) else "V1 runner"
        graphs = "eager" if ex.enforce_eager else "compiled, CUDA graphs" if config.device_config.device_type == "cuda" \
            else "compiled"
        rejected: list = []

        def output(path: Path, store_dtype: str) -> dict:  # an output's vx.json; its shards' metadata
            meta = {"model": str(model_dir), "layer_ids": json.dumps(layers), "store_dtype": store_dtype,
                    "model_type": info.model_type, "format": "vx-1"}
            path.mkdir(parents=True, exist_ok=True)
            (path / "vx.json").write_text(json.dumps(dict(meta, layer_ids=layers, hidden_size=info.hidden_size,
                                                          num_layers=info.num_layers)))
            return meta

        meta = output(out, "bf16")
        from vx.monitor.meter import Meter, Ticker
        from vx.monitor.probe import DeviceProbe

        meter = Meter()  # the live figures' device readings (NVML on a GPU), taken as vx runs
        meter.sources.append(DeviceProbe())
        meter.state = "running"
        ticker = Ticker(meter, [], every=0.2).start()
        t = time.perf_counter()
        try:
            stats = ex.run(samples, out, meta, 1 << 30, 0, info.hidden_size, "bf16",
                           on_reject=lambda s, why: rejected.append((s.id, why)))
        finally:
            ticker.stop()
        wall = time.perf_counter() - t
        stressed = ex.run(samples, stress_out, output(stress_out, "fp8"), 1 << 20, 0, info.hidden_size, "fp8",
                          compress="blocks", on_reject=lambda s, why: rejected.append((s.id, why)),
                          backpressure_s=WRITER_HOLD_S)
    finally:
        ex.close()
    if rejected:
        raise VxError(f"selftest: vx rejected {len(rejected)} samples, first {rejected[0][0]!r}: {rejected[0][1]}")
    return wall, (f"{runner}, {graphs}, step {ex.max_num_batched_tokens:,} tokens, max_num_seqs {ex.max_num_seqs:,}, "
                  f"max_model_len "
                  f"{ex.max_model_len:,}, warm-up {ex.warmup_s:.1f}s; capture chunk {stats.get('chunk_rows'):,} "
                  f"rows, hidden-state block {stats.get('hidden_block')} tokens, pinned ring {stats.get('ring_bytes', 0) / 2**20:,.0f}"
                  f" MiB ({stats.get('ring_waits', 0)} waits, {stats.get('ring_spills', 0)} spills), written from it "
                  f"{_share(stats.get('zero_copy_rows', 0), stats.get('copied_rows', 0))}; capture threads' CPU "
                  f"{stats.get('intake_cpu_s', 0):.2f}s intake + {stats.get('writer_cpu_s', 0):.2f}s writer over "
                  f"{wall:.1f}s; {_device(meter.totals)}; vx's changes to vLLM active in the engine (read back "
                  f"from rank 0): {', '.join(ex.active_changes) or 'none'}"
                  + (f"; memory plan: {ex.plan.line()}" if ex.plan is not None else "")), stressed


def _device(t: dict) -> str:
    """What the live figures read from the device while vx ran (vx/monitor/probe.py)."""
    mem = t.get("device_memory_peak_bytes")
    util = t.get("gpu_utilization_mean")
    if util is not None:
        return f"NVML: up to {mem / 2**30:,.1f} GiB in use, GPU utilisation {util:.0%} on average"
    return f"resident memory up to {mem / 2**30:,.1f} GiB (no GPU: no NVML)" if mem else "no device readings"


def _share(zero_copy: int, copied: int) -> str:
    """What share of the captured rows the writer wrote straight from the pinned ring."""
    return "n/a (inline on CPU)" if not zero_copy + copied else f"{zero_copy / (zero_copy + copied):.0%} of rows"


def _run_bare(model_dir, samples, work: Path, common: dict) -> float:
    """Bare vLLM prefill (no capture) of the same samples with the same engine settings."""
    from vx.device import engine_env
    from vx.engine.lifetime.logs import engine_output, without_tokenizer
    from vx.engine.lifetime.liveness import start_watched
    from vx.engine.lifetime.reaper import Reaper
    from vx.engine.vllm_engine import (
        engine_kwargs,
        prompt_ids,
        stop_engine,
        tokens_input,
        warm_up,
        warms_buckets,
    )

    on_cpu = engine_env(common["tensor_parallel_size"])
    patches.enable()  # the same vLLM as vx's engine runs (its CPU changes), for a like-for-like baseline
    kwargs = engine_kwargs(model_dir, [0], on_cpu=on_cpu, **common)
    for k in ("speculative_config", "kv_transfer_config", "worker_extension_cls"):
        kwargs.pop(k)
    reaper = Reaper.start()
    without_tokenizer()
    try:
        with engine_output(work / "logs" / "vllm-bare.log"):
            from vllm import LLM, SamplingParams

            llm, watch = start_watched(lambda: LLM(**kwargs), kept="rerun vx selftest")
        engine = watch.guard(llm.llm_engine)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            warm_up(engine, common["max_num_batched_tokens"], common["max_model_len"], params,
                    buckets=warms_buckets("cpu" if on_cpu else "cuda", kwargs["enforce_eager"]))
            t = time.perf_counter()
            for i, s in enumerate(samples):
                engine.add_request(f"bare-{i}", tokens_input(prompt_ids(s)), params)
            while engine.has_unfinished_requests():
                engine.step()
            return time.perf_counter() - t
        finally:
            stop_engine(llm.llm_engine, watch)
    finally:
        reaper.stop()


def _check(outs: list[tuple[Path, str]], samples, model_dir, info) -> tuple[list[tuple[list, list, object]], str]:
    """Every sample stored under each (output, store dtype) against one HF reference forward on
    this device. Returns per output (per layer the worst, one line per failure, the bound) and
    the reference's description."""
    from vx.engine.reference import Reference, bound
    from vx.store.reader import open_dataset

    dss = [open_dataset(out) for out, _ in outs]
    ref = Reference(model_dir, dss[0].layer_ids, info.model_type)
    results = []
    for ds, (_, dtype) in zip(dss, outs):
        missing = sorted({s.id for s in samples} - set(ds.ids))
        worst = {k: {"layer": k, "min_cosine": 1.0, "max_rel_diff": 0.0, "worst_sample": None} for k in ds.layer_ids}
        results.append((worst, [f"{len(missing)} samples missing from the output, first {missing[0]!r}"] if missing
                        else [], bound(info.model_type, ref.dtype, dtype), set(ds.ids)))
    for s in samples:
        states = None
        for ds, (worst, failures, limit, stored) in zip(dss, results):
            if s.id not in stored:
                continue
            item = ds[s.id]
            if item["input_ids"].tolist() != s.input_ids:
                failures.append(f"sample {s.id!r}: stored token ids differ from the submitted ones")
                continue
            states = ref.states(s.id, s.input_ids) if states is None else states
            for r in ref.check(s.id, s.input_ids, item["hidden_states"], ref=states, limit=limit):
                w = worst[r["layer"]]
                if r["cosine"] < w["min_cosine"]:
                    w.update(min_cosine=r["cosine"], worst_sample=s.id)
                w["max_rel_diff"] = max(w["max_rel_diff"], r["rel_diff"])
                if not r["ok"]:
                    failures.append(f"sample {s.id!r} layer {r['layer']}: cosine {r['cosine']:.6f}, max |diff| "
                                    f"{r['rel_diff']:.3g} x max |ref| (bound: cosine >= {limit.min_cosine}, "
                                    f"max |diff| <= {limit.max_rel_diff} x max |ref|)")
    ref.close()
    return [(list(w.values()), f, lim) for w, f, lim, _ in results], ref.why


def _compare(report: SelftestReport, out: Path, stressed_out: Path, stressed: dict, samples, model_dir,
             info) -> None:
    """Every sample of both runs (bf16; fp8 through a full ring) against the HF reference on this
    device; per layer the worst. The fp8 run's forward must have waited for ring space, or the
    stage proved nothing."""
    ((report.layers, failures, limit), (worst, fp8_failures, fp8)), why = _check(
        [(out, "bf16"), (stressed_out, "fp8")], samples, model_dir, info)
    report.failures += failures + [f"fp8 through a full ring: {f}" for f in fp8_failures]
    report.row("reference", f"HF {why}")
    report.row("bound", f"per sample and layer: cosine >= {limit.min_cosine}, max |diff| <= {limit.max_rel_diff} "
                        "x max |ref|")
    waits, spills = stressed.get("ring_waits", 0), stressed.get("ring_spills", 0)
    if not waits:
        report.failures.append("fp8 through a full ring: the ring never filled (the forward never waited), so the "
                               "backpressure path went untested; rerun with more --samples")
    cos, diff = min(w["min_cosine"] for w in worst), max(w["max_rel_diff"] for w in worst)
    from vx.store.reader import coded_sizes

    raw, coded = coded_sizes(stressed_out)
    report.row("backpressure", f"fp8 through a {stressed.get('ring_bytes', 0) / 2**20:,.1f} MiB ring (the copies in "
                               f"flight only), the writer started once it was full: {waits} waits, {spills} spills; "
                               f"states coded in blocks (--compress blocks) {raw / max(1, coded):.3f}x smaller; "
                               f"worst cosine {cos:.6f}, max |diff| {diff:.3g} x max |ref| (fp8 bound: cosine >= "
                               f"{fp8.min_cosine}, max |diff| <= {fp8.max_rel_diff})")
    report.result.update(backpressure={"ring_bytes": stressed.get("ring_bytes", 0), "ring_waits": waits,
                                       "ring_spills": spills, "min_cosine": cos, "max_rel_diff": diff,
                                       "coded_ratio": raw / max(1, coded)})
