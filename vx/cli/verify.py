"""`vx verify`: checksums and a recompute of random samples against the HF reference."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from vx.cli.app import app


@app.command(no_args_is_help=True,
             short_help="Check every shard against the manifest and recompute samples with HF; exit 1 on mismatch.")
def verify(
    output: Annotated[str, typer.Argument(help="An extraction output directory, or s3://bucket/prefix.")],
    model: Annotated[Optional[str], typer.Option(help="Model to recompute with. Default: the one in vx.json.")] = None,
    samples: Annotated[int, typer.Option(help="Random committed samples to recompute (0: checksums only).")] = 8,
    min_cosine: Annotated[Optional[float], typer.Option(help="Per sample and layer, cosine below this is a mismatch. Default: the bound for the reference's dtype (fp32 when it fits this machine's free memory, else bf16), the stored dtype and the model family.")] = None,
    device: Annotated[Optional[str], typer.Option(help="Device of the HF reference. Default: cuda if available, else cpu.")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print as one JSON object.")] = False,
):
    """Check every shard against the manifest and recompute samples with HF; exit 1 on mismatch.

    Examples:

      vx verify out/

      vx verify out/ --samples 32 --model /models/Qwen3.6-27B

      vx verify s3://bucket/run1 --endpoint-url http://minio:9000
    """
    from vx.errors import VxError
    from vx.jobs.verify import verify as run_verify

    r = run_verify(output, model, samples, min_cosine, endpoint_url=endpoint_url, device=device)
    summary = report_json(r)
    if json_out:
        print(json.dumps(summary))
    else:
        print(f"shards       {r.shards_checked} checked, {len(r.bad_shards)} bad" + (f" {r.bad_shards}" if r.bad_shards else "")
              + (f"; {r.dropped_shards} dropped by --retain-gb once consumed (not checked)" if r.dropped_shards else ""))
        if r.duplicate_ids:
            print(f"duplicates   {len(r.duplicate_ids)} sample ids committed twice: {r.duplicate_ids[:5]}")
        for line in report_lines(r):
            print(line)
        print("result       " + ("OK" if r.ok else "MISMATCH"))
    if not r.ok:
        raise VxError("verification failed: " + failure(r))


def report_json(r) -> dict:
    return {"ok": r.ok, "shards_checked": r.shards_checked, "bad_shards": r.bad_shards, "dropped_shards": r.dropped_shards,
            "duplicate_ids": r.duplicate_ids[:20], "samples_checked": len({s["id"] for s in r.samples}),
            "reference": r.reference, "min_cosine": r.min_cosine, "max_rel_diff": r.max_rel_diff,
            "layers": r.worst_by_layer()}


def report_lines(r) -> list[str]:
    """The recompute's table: per layer the worst cosine and max |diff| (shared with extract --verify)."""
    n = len({s["id"] for s in r.samples})
    bound = f"cosine >= {r.min_cosine}" + (f", max |diff| <= {r.max_rel_diff} x max |ref|" if r.max_rel_diff else "")
    lines = [f"samples      {n} recomputed with the HF reference, {r.reference or 'not run'}",
             f"bound        {bound}"]
    for w in r.worst_by_layer():
        lines.append(f"layer {w['layer']:<6} min cosine {w['min_cosine']:.6f}   max |diff| {w['max_rel_diff']:.3g} x "
                     f"max |ref| ({w['max_abs_diff']:.3g})   (worst: sample {w['worst_sample']})")
    return lines


def failure(r) -> str:
    if r.bad_shards:
        return "bad shards " + ", ".join(r.bad_shards)
    if r.duplicate_ids:
        return f"{len(r.duplicate_ids)} duplicated samples"
    bad = min((s for s in r.samples if not s["ok"]), key=lambda s: s["cosine"])
    return (f"sample {bad['id']!r} layer {bad['layer']}: cosine {bad['cosine']:.6f}, max |diff| "
            f"{bad['rel_diff']:.3g} x max |ref| against the reference (bound: cosine >= {r.min_cosine})")
