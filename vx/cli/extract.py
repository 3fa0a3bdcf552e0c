"""`vx extract`: the main job."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Optional

import typer

from vx.cli.app import app
from vx.data.generation import Generation
from vx.cli.options import (
    ChatTemplate,
    ChatTemplateKwargs,
    IdField,
    JsonSummary,
    Layers,
    MessagesField,
    MetricsPort,
    ModelPath,
    OutputDir,
    Progress,
    ProgressEvery,
    with_engines,
    with_generation,
)


@app.command(no_args_is_help=True,
             short_help="Hidden states of chosen layers for every token of every sample (--regenerate: the "
                        "target writes the assistant turns in the same run).")
@with_engines()
@with_generation("--regenerate: ")
def extract(
    data: Annotated[str, typer.Argument(help="Dataset: a .jsonl(.gz/.zst), .parquet or .arrow file, a datasets save_to_disk directory, a directory or glob of such files, or s3://bucket/key-or-prefix. Records: messages / conversations / text / input_ids.", show_default=False)],
    output: OutputDir = "out",
    model: ModelPath = None,
    backend: Annotated[str, typer.Option(help="auto (vllm when installed, else hf), vllm, or hf.")] = "auto",
    layers: Layers = None,
    batch_size: Annotated[int, typer.Option(help="hf: max samples per forward.")] = 128,
    max_batch_tokens: Annotated[int, typer.Option(help="hf: max padded tokens (samples x longest) per forward.")] = 65536,
    sort_window: Annotated[int, typer.Option(help="hf: samples sorted by length together.")] = 8192,
    max_length: Annotated[Optional[int], typer.Option(help="Longest sample in tokens; see --overlong.")] = None,
    overlong: Annotated[str, typer.Option(help="truncate or skip samples over --max-length.")] = "truncate",
    messages_field: MessagesField = "messages",
    text_field: Annotated[str, typer.Option(help="Record field holding plain text (loss on every token).")] = "text",
    id_field: IdField = "id",
    chat_template: ChatTemplate = None,
    chat_template_kwargs: ChatTemplateKwargs = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto (the checkpoint's; with --backend hf on a CPU without bf16 instructions, float32), bfloat16, float16, float32.")] = "auto",
    store_dtype: Annotated[str, typer.Option(help="Stored hidden-state dtype: bf16, fp16, fp32, fp8 (e4m3 + a float32 scale per token per layer; the reader dequantizes).")] = "bf16",
    shard_size: Annotated[float, typer.Option(help="Target shard size in MB.")] = 1024.0,
    strict: Annotated[bool, typer.Option(help="Any bad dataset line is fatal, checked before any compute.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Delete an existing extraction in --output first.")] = False,
    device: Annotated[Optional[str], typer.Option(help="hf: torch device (default cuda if available, else cpu).")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="vllm: tokens per engine step. Default: vLLM's offline default for the device (16,384 on a GPU of 70 GB or more, 8,192 below; 16,384 on CPU), smaller where two full steps would not fit the KV blocks beside the weights (the summary's 'memory plan' line).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vllm: requests per engine step. Default: the fewest consecutive samples of this run that fill a step in 99% of its stretches, + 1, twice that with async scheduling (a GPU's default); vLLM's own 1,024 profiles the sampler's logits for 1,024 requests, taken from the KV cache.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="vllm: the engine's longest request in tokens. Default: the longest sample this run submits + 1, rounded up to a whole block of the hidden-state cache (vx plans the engine's memory with vLLM's planner before loading weights; the summary's 'memory plan' line). The model's 262,144 would reserve capture memory no request uses, and stops vLLM where one such request does not fit.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vllm: fraction of GPU memory (of host memory on CPU) for the engine. Default 0.9 on GPU, 0.3 on CPU. With --regenerate on a GPU: the whole GPU's, split between the two engines by the capture's plan (printed), or refused in one line where both cannot fit.")] = None,
    engines: dict = None,  # --tensor-parallel-size, --dp, --gpus, --ray-address, --max-retries (with_engines)
    enforce_eager: Annotated[Optional[bool], typer.Option("--enforce-eager/--no-enforce-eager", help="vllm: --enforce-eager runs without torch.compile and CUDA graphs; --no-enforce-eager compiles. Default: compiled on GPU, eager on CPU (faster there, see docs/performance.md).")] = None,
    upload: Annotated[Optional[str], typer.Option(help="Mirror committed shards to s3://bucket/prefix (or give -o s3://...).")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL (credentials: the standard AWS chain).")] = None,
    max_local_gb: Annotated[Optional[float], typer.Option(help="Bound local shard bytes; extraction waits for uploads (backpressure).")] = None,
    keep_local: Annotated[bool, typer.Option(help="Keep local shards after they are uploaded and verified.")] = False,
    retain_gb: Annotated[Optional[float], typer.Option(help="Train while extracting with bounded storage: delete shards once every vx.loader(follow=True) rank has committed them, and wait while unconsumed shards would exceed this many GB (local and S3).")] = None,
    compress: Annotated[Optional[str], typer.Option(help="blocks: code each ~1 MiB of rows losslessly (bf16 ~1.4x smaller; a sample is still one byte range: loader, follow and S3 row reads as before). zstd: each shard file as one frame (~1.25x; the reader decompresses whole shards into memory).")] = None,
    num_partitions: Annotated[int, typer.Option(help="Split the dataset into this many token-balanced partitions (the unit of work and of retry). Default: one per engine.")] = 1,
    partition_index: Annotated[Optional[int], typer.Option(help="Run only this partition (0-based) of --num-partitions, resumable: for SLURM arrays and other batch schedulers.")] = None,
    ray: Annotated[bool, typer.Option(help="Run the partitions as Ray tasks on an existing Ray cluster (use -o s3://... so every node writes to the same place).")] = False,
    regenerate: Annotated[bool, typer.Option(help="One pass: the target first writes every assistant turn (as vx regenerate, into OUT/regenerated.jsonl) and each regenerated conversation's states are captured as soon as it is committed, the two engines running side by side. With --data-parallel-size/--gpus each engine slot does this for its share of the prompts. With -o s3://... the text goes to S3 before its states, and a rerun anywhere continues from S3. The generation options below apply.")] = False,
    generation: Generation = None,  # --turns ... --drop-truncated (vx/cli/options.py with_generation)
    verify: Annotated[int, typer.Option(help="After the run, recompute this many random committed samples with the HF reference on this machine's device (once the engine has released it) and compare every layer; exit 1 below the bound. 0: off.")] = 0,
    progress: Progress = None,
    progress_every: ProgressEvery = None,
    metrics_port: MetricsPort = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show vLLM's INFO log live on stderr (it is always written to OUT/logs/).")] = False,
    json_summary: JsonSummary = False,
):
    """Extract target-layer hidden states for every token of every sample.

    Examples:

      vx extract examples/chat.jsonl -o out/

      vx extract chats.jsonl -o out/ --model /models/Qwen3.6-27B --layers 1,16,31,46,61

      vx extract chats.jsonl -o out/ --backend hf --batch-size 64 --max-length 4096 --overlong skip

      vx extract 'data/train-*.parquet' -o out/ --messages-field conversation --chat-template-kwargs '{"enable_thinking": false}'

      vx extract chats.jsonl -o s3://bucket/run1 --model /models/Qwen3.6-27B --gpus 0,1,2,3,4,5,6,7

      vx extract chats.jsonl -o s3://bucket/run1 --model /models/big --ray --tensor-parallel-size 2 --num-partitions 64

      vx extract chats.jsonl -o s3://bucket/run1 --num-partitions 16 --partition-index $SLURM_ARRAY_TASK_ID

      vx extract prompts.jsonl -o out/ --regenerate --temperature 0.7 --max-tokens 2048
    """
    from vx.data.layers import parse_layer_ids
    from vx.jobs import extract as extract_job
    from vx.jobs import one_pass
    from vx.jobs.config import ExtractConfig
    from vx.jobs.extract import require_samples
    from vx.launch.launcher import launch

    cfg = ExtractConfig(
        data=data, output=output, model=model, backend=backend, layers=parse_layer_ids(layers),
        batch_size=batch_size, max_batch_tokens=max_batch_tokens, sort_window=sort_window, max_length=max_length,
        overlong=overlong, messages_field=messages_field, text_field=text_field, id_field=id_field,
        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, verbose=verbose, dtype=dtype, store_dtype=store_dtype, shard_size_mb=shard_size, strict=strict,
        overwrite=overwrite, device=device, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, verify=verify, gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager, upload=upload,
        endpoint_url=endpoint_url, max_local_gb=max_local_gb, keep_local=keep_local, retain_gb=retain_gb, compress=compress,
        num_partitions=num_partitions, partition_index=partition_index, ray=ray, regenerate=regenerate,
        metrics_port=metrics_port, progress_every=progress_every, **engines, **asdict(generation),
    )
    # in this process, on this node's engine slots, or on Ray (vx/launch/launcher.py)
    s = launch(one_pass if cfg.regenerate else extract_job, cfg, progress=progress)
    require_samples(cfg, s)
    report = None
    if cfg.verify:  # the engine has released the device: the HF reference runs there now
        from vx.cli.verify import report_json
        from vx.jobs.verify import verify as run_verify

        target = cfg.upload if cfg.upload and not cfg.keep_local else str(cfg.output)
        report = run_verify(target, cfg.model, cfg.verify, endpoint_url=cfg.endpoint_url)
    if json_summary:
        print(json.dumps(dict(s.to_json(), **({"verify": report_json(report)} if report else {}))))
    else:
        _print_summary(s, report)
    if report is not None and not report.ok:
        from vx.cli.verify import failure
        from vx.errors import VxError

        raise VxError(f"--verify {cfg.verify}: " + failure(report))


def _print_summary(s, report) -> None:
    print(f"output       {s.output}")
    if s.regenerated:
        r = s.regenerated
        print(f"regenerated  {r.get('conversations', 0):,} conversations, {r.get('turns', 0):,} turns, "
              f"{r.get('generated_tokens', 0):,} tokens generated, {r.get('truncated', 0):,} truncated, "
              f"{r.get('skipped', 0):,} already committed ({r.get('output') or 'OUT/regenerated.jsonl'})")
    print(f"backend      {s.backend}")
    print(f"samples      {s.samples:,} extracted, {s.resumed_samples:,} already committed, {s.errors:,} bad records "
          f"(see errors.jsonl)")
    print(f"tokens       {s.tokens:,}")
    print(f"written      {s.shards} shards, {s.bytes_written / 1e6:,.1f} MB")
    print(f"time         load {s.load_s:.1f}s, warm-up {s.warmup_s:.1f}s, extract {s.extract_s:.1f}s")
    if s.max_model_len:
        print(f"engine       max_model_len {s.max_model_len:,} (the longest sample + 1 rounded up to a whole "
              "hidden-state block, unless --max-model-len)")
    if s.engine_plan:
        print(f"memory plan  {s.engine_plan}; engine's hidden-state block {s.hidden_block} tokens")
    print(f"speed        {s.samples_per_s:,.2f} samples/s, {s.tokens_per_s:,.0f} tokens/s"
          + (f", MFU {s.mfu:.1%} of {s.peak}" if s.mfu is not None else ""))
    d = s.device or {}
    if d.get("device_memory_peak_bytes") or d.get("gpu_utilization_mean") is not None:
        print("device       " + ", ".join(x for x in (
            f"peak memory in use {d['device_memory_peak_bytes'] / 1e9:,.2f} GB" if d.get("device_memory_peak_bytes") else "",
            f"GPU utilisation {d['gpu_utilization_mean']:.0%} on average" if d.get("gpu_utilization_mean") is not None
            else "") if x))
    if s.upload:
        print(f"uploaded     {s.uploaded_bytes / 1e6:,.1f} MB to {s.upload} at {s.upload_mb_s:,.1f} MB/s; "
              f"peak local shards {s.peak_local_bytes / 1e6:,.1f} MB")
    if s.partitions:
        for p in s.partitions:
            print(f"partition {p['partition']:<3} {p['samples']:,} samples, {p['tokens']:,} tokens, "
                  f"extract {p['extract_s']:.1f}s, done at {p['finished_s']:.1f}s"
                  + (f", node {p['node']} ({(p.get('node_id') or '')[:8]}), {p['attempts']} attempt(s)" if p.get("node") else ""))
        b = s.balance
        print(f"balance      token spread {b['token_spread']:.1%} across {len(s.partitions)} partitions, finish times "
              f"within {b['finish_spread_s']:.1f}s")
    if report is not None:
        from vx.cli.verify import report_lines

        for line in report_lines(report):
            print(line)
        print("verify       " + ("OK" if report.ok else "MISMATCH"))
