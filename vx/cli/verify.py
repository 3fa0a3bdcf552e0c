"""`vx verify`: checksums and a recompute of random samples against the HF reference."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from . import app


@app.command(no_args_is_help=True)
def verify(
    output: Annotated[str, typer.Argument(help="An extraction output directory, or s3://bucket/prefix.")],
    model: Annotated[Optional[str], typer.Option(help="Model to recompute with. Default: the one in vx.json.")] = None,
    samples: Annotated[int, typer.Option(help="Random committed samples to recompute (0: checksums only).")] = 8,
    min_cosine: Annotated[float, typer.Option(help="Per sample and layer, cosine below this is a mismatch.")] = 0.999,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print as one JSON object.")] = False,
):
    """Check every shard against the manifest and recompute samples with HF; exit 1 on mismatch.

    Examples:

      vx verify out/

      vx verify out/ --samples 32 --model /models/Qwen3.6-27B

      vx verify s3://bucket/run1 --endpoint-url http://minio:9000
    """
    from ..errors import VxError
    from ..verify import verify as run_verify

    r = run_verify(output, model, samples, min_cosine, endpoint_url=endpoint_url)
    worst = {}
    for s in r.samples:
        w = worst.setdefault(s["layer"], {"layer": s["layer"], "min_cosine": 1.0, "max_abs_diff": 0.0})
        w["min_cosine"] = min(w["min_cosine"], s["cosine"])
        w["max_abs_diff"] = max(w["max_abs_diff"], s["max_abs_diff"])
    summary = {"ok": r.ok, "shards_checked": r.shards_checked, "bad_shards": r.bad_shards,
               "duplicate_ids": r.duplicate_ids[:20],
               "samples_checked": len({s["id"] for s in r.samples}), "layers": list(worst.values())}
    if json_out:
        print(json.dumps(summary))
    else:
        print(f"shards       {r.shards_checked} checked, {len(r.bad_shards)} bad {r.bad_shards or ''}")
        if r.duplicate_ids:
            print(f"duplicates   {len(r.duplicate_ids)} sample ids committed twice: {r.duplicate_ids[:5]}")
        print(f"samples      {summary['samples_checked']} recomputed with the HF reference (fp32)")
        for w in worst.values():
            print(f"layer {w['layer']:<6} min cosine {w['min_cosine']:.6f}   max |diff| {w['max_abs_diff']:.3g}")
        print("result       " + ("OK" if r.ok else "MISMATCH"))
    if not r.ok:
        why = ("bad shards " + ", ".join(r.bad_shards) if r.bad_shards else
               f"{len(r.duplicate_ids)} duplicated samples" if r.duplicate_ids else f"cosine below {min_cosine}")
        raise VxError("verification failed: " + why)
