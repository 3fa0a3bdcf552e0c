"""`vx selftest`: prove this install on this machine before a long run; attach its table to bug reports."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from vx.cli.app import app
from vx.cli.options import ModelPath, parse_gpus


@app.command(short_help="Check this install end to end on a small random twin of your target, every sample against HF.")
def selftest(
    model: ModelPath = None,
    gpus: Annotated[Optional[str], typer.Option(help="GPU ids to run on (of those this process sees), e.g. 0 or 0,1 with --tensor-parallel-size 2. Default: the first --tensor-parallel-size visible GPUs.")] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="vllm: GPUs per engine.")] = 1,
    samples: Annotated[Optional[int], typer.Option(help="Samples in the synthetic mix. Default: 40 on CPU, 128 on a GPU.")] = None,
    bench: Annotated[bool, typer.Option("--bench/--no-bench", help="Also time bare vLLM prefill of the same data (tokens/s, vx's ratio, MFU).")] = True,
    one_pass: Annotated[bool, typer.Option("--one-pass/--no-one-pass", help="Also run vx extract --regenerate on a few conversations (two engines side by side) and check its stored ids and states.")] = True,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="vllm: tokens per engine step. Default: vx's GPU default (8192); 512 on CPU.")] = None,
    enforce_eager: Annotated[Optional[bool], typer.Option("--enforce-eager/--no-enforce-eager", help="vllm: default as for extract (compiled with CUDA graphs on a GPU, eager on CPU).")] = None,
    upload: Annotated[Optional[str], typer.Option(help="Also send the shards to this s3://bucket/prefix (under a fresh prefix of their own, deleted after) through vx's uploader, read every sample back by byte range, and check a 12 MiB multipart upload's full-object checksum: your S3 path, proven.")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL for --upload (credentials: the standard AWS chain).")] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Keep the shards and engine logs here (default: a temporary directory, removed).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    report: Annotated[Optional[str], typer.Option(help="Also write the result as JSON to this file (with the table on stdout).")] = None,
):
    """Check this install end to end in minutes: vLLM's contract, vx's real capture path on a
    small random model of your target's architecture (its config, a few layers) over a length mix
    that breaks batched capture (1-token, chunked, shared-prefix and identical samples), every
    sample against the HF reference on the same device, bare vLLM prefill vs vx on the same
    data, and the one-pass mode (vx extract --regenerate: ids against the template's rendering
    of what it regenerated, states against HF). Prints one table; exit 0, or 1 naming the first sample and layer outside the bound.

    Examples:

      vx selftest

      vx selftest --model /models/Qwen3.6-27B --gpus 0

      vx selftest --model /models/Qwen3.6-27B --gpus 0,1 --tensor-parallel-size 2

      vx selftest --model /models/Qwen3.6-27B --upload s3://my-bucket/scratch
    """
    from pathlib import Path

    from vx.errors import VxError
    from vx.selftest.run import SelftestConfig, run_selftest

    _use_gpus(parse_gpus(gpus), tensor_parallel_size)
    cfg = SelftestConfig(model=model, tensor_parallel_size=tensor_parallel_size, samples=samples, bench=bench, one_pass=one_pass,
                         max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                         output=Path(output) if output else None, upload=upload, endpoint_url=endpoint_url)
    r = run_selftest(cfg)
    result = {"ok": r.ok, "rows": dict(r.lines), "layers": r.layers, "failures": r.failures[:20], **r.result}
    if report:
        Path(report).write_text(json.dumps(result, indent=2) + "\n")
    if json_out:
        print(json.dumps(result))
    else:
        for label, text in r.lines:
            print(f"{label:<12} {text}")
        print(f"{'layer':<12} {'min cosine':>12} {'max |diff| / max |ref|':>24}   worst sample")
        for w in r.layers:
            print(f"{w['layer']:<12} {w['min_cosine']:>12.6f} {w['max_rel_diff']:>24.4g}   {w['worst_sample']}")
        print(f"{'result':<12} " + ("PASS" if r.ok else f"FAIL ({len(r.failures)} sample-layers outside the bound)"))
    if not r.ok:
        raise VxError("selftest failed: " + r.failures[0])


def _use_gpus(gpus: list[int] | None, tp: int) -> None:
    """--gpus picks among the GPUs this process sees (an inherited CUDA_VISIBLE_DEVICES is honoured)."""
    import os

    if gpus is None:
        return
    from vx.device import gpu_groups
    from vx.errors import UsageError

    if len(gpus) != tp:
        raise UsageError(f"--gpus lists {len(gpus)} GPUs for one engine of --tensor-parallel-size {tp}")
    ids = gpu_groups(gpus, tp)
    if ids is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
