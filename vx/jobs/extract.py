"""The extraction job: dataset -> tokens -> target-layer states -> committed shards.

As the launcher runs it (vx/launch/launcher.py, vx/launch/job.py): prepare() once (the output's
identity, --overwrite, S3 preflight, the partition plan), run() = run_extract for one partition or
the whole input in whatever process, finish() once (the partitions' summaries combined).

Over 300 lines: the job's three functions beside the body of one run they share.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Iterator

from vx import __version__
from vx.data.layers import resolve_layer_ids
from vx.data.model import load_tokenizer, model_info, resolve_model
from vx.data.samples import BadLine, Sample, Tokenize, read_samples
from vx.errors import UsageError, VxError
from vx.jobs.config import ExtractConfig
from vx.jobs.summary import Summary, combine
from vx.monitor.publish import watch_writer
from vx.monitor.flops import mfu_terms
from vx.monitor.progress import RunProgress
from vx.store.format import ERRORS
from vx.store.output import ErrorLog, Output
from vx.store.writer import ShardWriter


NAME, LABEL = "extract", "extract"
MEMORY_SHARE = 0.3  # of a CPU node's host memory, for all its engines
# under --retain-gb a writer waits for readers to consume its shards, and a reader following the
# run waits for the failed partition's next ones: the others would wait for good, so they are stopped
RETAIN_STOP = "under --retain-gb its writer would wait for readers that wait for the failed partition"


def config(d: dict) -> ExtractConfig:
    return ExtractConfig(**d)


def prepare(cfg: ExtractConfig):
    """Once, before any partition's worker: the job (model, layers), the dataset under --strict,
    the root output (identity, --overwrite, S3 preflight) and the partition plan."""
    from vx.engine.lifetime.logs import LOG_DIR
    from vx.launch.job import Prepared

    job = prepare_job(cfg)
    if cfg.strict:
        check_dataset(cfg, job)
    prepare_root(cfg, job)
    t_plan = time.perf_counter()
    plan_file, balance = make_plan(cfg, job)
    balance["plan_s"] = round(time.perf_counter() - t_plan, 2)
    todo = sum(balance["lines"]) - len(Output.of(cfg).committed_elsewhere())
    return Prepared(cfg, plan_file, balance["lines"], todo, Path(cfg.output) / LOG_DIR, "Committed shards are kept",
                    RETAIN_STOP if cfg.retain_gb else None, extra={"job": job, "balance": balance})


def make_plan(cfg: ExtractConfig, job) -> tuple[str, dict]:
    import numpy as np

    from vx.launch.plan import load_or_make_plan

    path = load_or_make_plan(cfg.output, job.source, job.model_dir, job.info.fingerprint, cfg.num_partitions,
                             cfg.reading())
    plan = np.load(path)
    return str(path), {"lines": [int((plan == p).sum()) for p in range(cfg.num_partitions)]}


def worker_config(prep, index: int, plan_file: str | None, cpu_share: float | None, portable: bool = False) -> dict:
    """The JSON config of one partition's worker. cpu_share: on CPU, vLLM's memory fraction is of
    host memory, which the engines of a node share. portable: for a worker on any machine (-o
    s3://... staged by each worker itself)."""
    child = replace(prep.cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, overwrite=False,
                    partition_index=index, plan_file=plan_file, verify=0,  # the launcher verifies the whole run
                    metrics_port=None, progress_every=None)  # and serves the metrics, labelled by partition
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.portable_json() if portable else child.to_json()


def watch(bar, prep, engines: int):
    """The launcher's live figures: MFU over its engines, device memory, the workers' sums; --metrics-port."""
    from vx.monitor.publish import watch_launcher

    job, cfg = prep.extra["job"], prep.cfg
    prep.extra["terms"] = mfu_terms(job.model_dir, job.layer_ids, engines, cfg.tensor_parallel_size)
    return watch_launcher(bar, cfg, prep.extra["terms"])


def finish(prep, results: dict[int, dict], t0: float) -> Summary:
    """Once every partition is done: one Summary of them."""
    s = combine(prep.cfg, prep.extra["job"].backend, results, time.perf_counter() - t0,
                time.perf_counter() - prep.t_start, prep.extra["balance"])
    s.set_mfu(prep.extra["terms"], prep.bar.meter)
    return s


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "vllm" if vllm_available() else "hf"
    if requested == "vllm" and not vllm_available():
        raise UsageError("--backend vllm needs vLLM: pip install 'vx[cpu]' (CPU) or 'vx[gpu]' (GPU)")
    return requested


@dataclass
class Job:
    """What every worker of one extraction shares: the model, its layers, the output's identity."""
    backend: str
    model_dir: Path
    info: object
    layer_ids: list[int]
    tokenizer: object
    meta: dict
    target: object | None  # S3Target of the root output, or None
    source: object         # the input dataset (vx/data/inputs.py Input)
    tokenize: Tokenize


def prepare_job(cfg: ExtractConfig, source=None) -> Job:
    """source: the input, when it is not cfg.data as read (one-pass: the regeneration followed)."""
    backend = choose_backend(cfg.backend)
    reading = cfg.reading()
    source = source if source is not None else cfg.source()
    model_dir = resolve_model(cfg.model)
    info = model_info(model_dir)
    layer_ids = resolve_layer_ids(cfg.layers, info.num_layers)
    tokenizer = load_tokenizer(model_dir)
    tokenize = Tokenize(tokenizer, reading, info.vocab_size)
    target = None
    if cfg.upload:  # after the local checks, before the model loads: endpoint, credentials, bucket, write access
        from vx.store.s3_client import parse_s3_url
        from vx.store.s3 import preflight

        target = parse_s3_url(cfg.upload)
        preflight(target, cfg.endpoint_url)
    meta = {
        "format": "vx-1", "vx_version": __version__, "model": str(model_dir), "model_type": info.model_type,
        "model_fingerprint": info.fingerprint,
        "num_layers": info.num_layers, "layer_ids": layer_ids, "hidden_size": info.hidden_size,
        "store_dtype": cfg.store_dtype, "compress": cfg.compress or "none", "backend": backend,
    }
    return Job(backend, model_dir, info, layer_ids, tokenizer, meta, target, source, tokenize)


def check_dataset(cfg: ExtractConfig, job: Job) -> None:
    """--strict: a full validation pass before any compute."""
    for item in read_samples(job.source, job.tokenize):
        if isinstance(item, BadLine):
            raise UsageError(f"{item.where}: {item.reason} (id {item.id!r}); --strict stops before any compute")


def prepare_root(cfg: ExtractConfig, job: Job) -> None:
    """Launchers, once before their workers start: --overwrite, identity, root vx.json (local and S3)."""
    Output.of(cfg).prepare_root(job.meta, cfg.overwrite)


def run_extract(cfg: ExtractConfig, progress: bool | None = None, reporter=None, source=None,
                started=None, before_publish=None, captured=None) -> Summary:
    """One process, one engine: the whole dataset, or one partition of it (cfg.partition_index).
    source: another input than cfg.data as read (vx/jobs/one_pass.py follows a regeneration);
    started(): called before the first sample, once the vLLM engine has started (hf: before its load);
    captured(): once every sample is committed, before the vLLM engine stops;
    before_publish(): with -o s3://, called before new shards are published (vx/store/uploader.py)."""
    t0 = time.perf_counter()
    job = prepare_job(cfg, source)
    if cfg.strict and not cfg.plan_file:  # a launcher (which hands out plan files) checked it once
        check_dataset(cfg, job)
    root = out = Output.of(cfg)
    lines = plan = None
    if cfg.partitioned:
        cfg, out, lines, plan = _enter_partition(cfg, job, root, whole_source=source is not None)
    lengths = None  # the samples' token counts: the engine's max_model_len and step budget
    if job.backend == "vllm":
        from vx.launch.plan import engine_lengths, max_model_len_for

        if plan is not None or not cfg.max_model_len:  # no plan is made for them alone
            lengths = engine_lengths(plan, cfg.output, job.source, job.model_dir, job.info.fingerprint,
                                     cfg.reading(), cfg.partition_index)
        if not cfg.max_model_len:
            cfg = replace(cfg, max_model_len=max_model_len_for(lengths, job.info.max_position_embeddings))
    out.reset_or_sync(cfg.overwrite)
    elsewhere = root.committed_elsewhere(exclude=out)  # other partitions, of this run or an earlier one
    with out.lock():
        out.take()  # with S3: this process is now the prefix's one writer (vx/store/fence.py)
        return _extract_locked(cfg, job, out, lines, elsewhere, progress, reporter, t0, root, started,
                               before_publish, captured, lengths)


run = run_extract  # the job's body: one partition, or the whole input, in this process


def _extract_locked(cfg, job, out: Output, lines, elsewhere, progress, reporter, t0, root=None,
                    started=None, before_publish=None, captured=None, lengths=None) -> Summary:
    meta, info, layer_ids = job.meta, job.info, job.layer_ids
    state = out.open(meta, cfg.overwrite)
    out.begin_run()
    if out.staged:
        out.publish_meta()  # from now on the S3 prefix holds this extraction
    skip = frozenset(state.committed_ids | elsewhere)
    shard_meta = {k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in meta.items()}
    if out.fence is not None:  # the writer's id names its shards: two attempts never write one key
        shard_meta["attempt"] = out.fence.owner.attempt
    max_local = int(cfg.max_local_gb * 1e9) if cfg.max_local_gb else None
    retain = int(cfg.retain_gb * 1e9 / (cfg.num_partitions if cfg.partitioned else 1)) if cfg.retain_gb else None
    if retain is not None:  # the writer's local backpressure is the bound: consumed shards leave both copies
        max_local = min(max_local or retain, retain)
    shard_args = (shard_meta, int(cfg.shard_size_mb * 1e6), state.next_shard, info.hidden_size, cfg.store_dtype,
                  max_local, cfg.compress)
    errors = ErrorLog(cfg.output)
    uploader = out.uploader(cfg.keep_local or retain is not None, max_local, before_publish)
    retainer = None
    if retain is not None:
        from vx.store.retention import start_retainer

        retainer = start_retainer(out, root or out, cfg.retain_gb, cfg.num_partitions if cfg.partitioned else 1, retain)
    total = len(lines) if lines is not None else job.source.count()
    total = None if total is None else max(0, total - len(state.committed_ids))
    bar = reporter if reporter is not None else RunProgress(total, enabled=progress, every=cfg.progress_every)
    terms = mfu_terms(job.model_dir, layer_ids, 1, cfg.tensor_parallel_size)
    metrics = watch_writer(bar, cfg, out, terms, errors, uploader, total)

    def good_samples() -> Iterator[Sample]:
        for item in read_samples(job.source, job.tokenize, skip_ids=skip, lines=lines):
            if uploader is not None:
                uploader.raise_if_lost()  # another writer took the prefix: stop computing for it
            if isinstance(item, BadLine):
                errors.write(item.to_json())
                bar.skip(1)
            else:
                yield item

    max_model_len, engine_plan = None, (None, None)
    try:
        samples = good_samples()
        first = next(samples, None)  # none left (a finished partition's rerun): no model is loaded
        if first is None:
            stats, shards, nbytes, peak_local = [0.0, 0.0, 0.0, 0, 0], 0, 0, 0
        elif job.backend == "hf":
            def reject(sample_id: str, reason: str, line: int | None) -> None:  # in the writer thread
                errors.write({"line": line, "id": sample_id, "reason": reason})
                if cfg.strict:
                    raise VxError(f"sample {sample_id!r} rejected: {reason} (--strict)")

            writer = ShardWriter(cfg.output, shard_meta, shard_args[1], state.next_shard, len(layer_ids),
                                 info.hidden_size, cfg.store_dtype, on_reject=reject, max_local_bytes=max_local,
                                 compress=cfg.compress)
            if started is not None:
                started()
            from vx.engine.hf_extractor import run_hf

            *stats, = run_hf(cfg, job.model_dir, layer_ids, job.tokenizer, chain([first], samples), writer,
                             bar, t0)
            shards, nbytes, peak_local = writer.committed_shards, writer.committed_bytes, writer.peak_local_bytes
        else:
            from vx.engine.vllm_extractor import run_vllm

            *stats, wstats = run_vllm(cfg, job.model_dir, info, layer_ids, chain([first], samples), shard_args, bar,
                                      t0, errors, started, captured, lengths)
            shards, nbytes = wstats.get("shards", 0), wstats.get("bytes", 0)
            peak_local = wstats.get("peak_local_bytes", 0)
            max_model_len = wstats.get("max_model_len")
            engine_plan = (wstats.get("hidden_block"), wstats.get("plan"))
            if cfg.strict and wstats.get("rejected"):
                raise VxError(f"{len(wstats['rejected'])} samples rejected (--strict): {wstats['rejected'][:3]}")
    except BaseException as e:
        lost = uploader.abandon() if uploader is not None else None  # committed shards still go up
        if retainer is not None:
            retainer.stop(raise_error=False)
        bar.close("failed")
        if lost is not None and isinstance(e, Exception):  # the loss of the prefix says more than what it caused
            raise lost from None
        raise  # else the original error wins
    finally:
        errors.close()
        if metrics is not None:
            metrics.close()
    try:
        up = uploader.finish() if uploader is not None else {}
        out.end_run()
    except BaseException:
        bar.close("failed")
        raise
    bar.close("done")  # the final record says done once the end is marked
    if retainer is not None:  # readers finish the stream after the end; what they consume now stays
        retainer.stop()
    load_s, warmup_s, extract_s, n, tokens = stats
    s = Summary(str(cfg.output), job.backend, n, tokens, errors.count, len(state.committed_ids),
                shards, nbytes, load_s, warmup_s, extract_s, str(out.target) if out.target else None,
                up.get("uploaded_bytes", 0), up.get("upload_mb_s", 0.0), peak_local,
                max_model_len if job.backend == "vllm" else None, *engine_plan)
    s.set_mfu(terms, bar.meter)
    return s


def require_samples(cfg: ExtractConfig, s: Summary) -> None:
    """A run in which no record could be read is a failure, not an empty success."""
    if s.samples or s.resumed_samples or Output.of(cfg).committed_elsewhere():
        return  # something was extracted, now or before (in this output or its partitions)
    source = cfg.source()
    if not s.errors:
        raise UsageError(f"{source} holds no records")
    first = Output.of(cfg).first_error()
    where = f"{first.get('file')}:{first.get('row')}" if first.get("file") else f"row {first.get('line')}"
    looks = source.describe_failure()
    raise UsageError(f"no sample could be read from {source}: all {s.errors:,} records are bad (first, {where}: "
                     f"{first.get('reason')})" + (f"; {looks}" if looks else "") + f". See {cfg.output / ERRORS}")


def _enter_partition(cfg: ExtractConfig, job: Job, root: Output, whole_source: bool = False):
    """A partition worker: join the root output and find its rows. Returns the config narrowed
    to the partition's own directory and S3 prefix, that partition's Output, and its rows (None:
    every row; whole_source: the input is already this partition's, a one-pass worker's
    regeneration, and no plan is read)."""
    from vx.launch.plan import lines_of, load_or_make_plan
    from vx.store.format import part_name

    root.join(job.meta)
    name = part_name(cfg.partition_index, cfg.num_partitions)
    out = root.partition(name)
    upload = str(out.target) if out.target is not None else None
    cfg = replace(cfg, output=out.local, upload=upload, staged=False)
    if whole_source:
        return cfg, out, None, None
    plan = Path(cfg.plan_file) if cfg.plan_file else load_or_make_plan(
        root.local, job.source, job.model_dir, job.info.fingerprint, cfg.num_partitions, cfg.reading())
    return cfg, out, lines_of(plan, cfg.partition_index), plan
