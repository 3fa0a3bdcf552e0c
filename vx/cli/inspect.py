"""`vx inspect`: what an output directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from vx.cli.app import app


@app.command(no_args_is_help=True,
             short_help="Summarise an output, watch a running extraction, or plot its history.")
def inspect(
    output: Annotated[str, typer.Argument(help="An extraction output: a directory, or s3://bucket/prefix with --watch or --plot.")],
    sample: Annotated[Optional[str], typer.Option(help="Show one sample (by id) with shapes and a few values.")] = None,
    watch: Annotated[bool, typer.Option(help="Follow a running extraction (every partition, any node, local or S3) from its writers' progress records: done of total, rate, ETA, per-partition rates; flags stalled or failing partitions; ends when the run ends.")] = False,
    interval: Annotated[float, typer.Option(help="--watch: seconds between polls.")] = 5.0,
    stall_after: Annotated[float, typer.Option(help="--watch: flag a partition that has committed nothing for this many seconds.")] = 300.0,
    plot: Annotated[Optional[str], typer.Option(help="Draw tokens/s and MFU over time per partition into this PNG file, from the writers' progress history.")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint URL for an s3:// output.")] = None,
    codecs: Annotated[bool, typer.Option("--codecs", help="Measure lossless codecs on this output's own stored states (up to --codec-mb of them, ~1 MiB blocks on one core): ratio, encode and decode GB/s, and that each decodes byte for byte.")] = False,
    codec_mb: Annotated[float, typer.Option(help="--codecs: MB of stored states to measure on.")] = 64.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print as one JSON object (--watch: one per poll, JSON lines).")] = False,
):
    """Summarise an extraction: samples, tokens, shards, bytes, layers, dtype, errors; or watch
    a running one, or plot its history.

    Examples:

      vx inspect out/

      vx inspect out/ --sample 42

      vx inspect out/ --codecs

      vx inspect s3://bucket/run1 --watch --stall-after 120

      vx inspect s3://bucket/run1 --plot run1.png
    """
    from vx.errors import UsageError

    if interval <= 0 or stall_after <= 0:
        raise UsageError("--interval and --stall-after must be > 0 seconds")
    if codec_mb <= 0:
        raise UsageError("--codec-mb must be > 0")
    if watch or plot:
        from vx.cli.watch import run_watch

        run_watch(output, endpoint_url, watch, interval, stall_after, plot, json_out)
        return
    if output.startswith("s3://"):
        raise UsageError("vx inspect reads an s3:// output with --watch or --plot; for its contents, use a local "
                         "copy (vx export) or the output's staging directory")
    output = Path(output)
    from vx.store.format import ERRORS
    from vx.store.output import output_dirs, part_dirs
    from vx.store.reader import open_dataset

    ds = open_dataset(output)
    if not ds.meta:
        raise UsageError(f"{output} is not a vx output directory (no vx.json)")
    if codecs:
        _codecs(ds, int(codec_mb * 1e6), json_out)
        return
    if sample is not None:
        if sample not in ds:
            raise UsageError(f"no sample with id {sample!r} in {output}")
        item = ds[sample]
        h = item["hidden_states"]
        info = {"id": sample, "tokens": int(h.shape[0]), "hidden_states": list(h.shape), "dtype": str(h.dtype),
                "layer_ids": ds.layer_ids, "loss_tokens": int(item["loss_mask"].sum()),
                "input_ids[:8]": item["input_ids"][:8].tolist(),
                "hidden_states[0, :, :4]": h[0, :, :4].float().tolist()}
        print(json.dumps(info) if json_out else "\n".join(f"{k:24} {v}" for k, v in info.items()))
        return
    bad_lines = set()  # by line: an 8-way run resumed 4-way may have reported a line twice
    for d in output_dirs(output):
        if (d / ERRORS).exists():
            bad_lines.update(json.loads(line).get("line") for line in open(d / ERRORS) if line.strip())
    n_err = len(bad_lines)
    nbytes = sum(r["bytes"] for r in ds.shards)
    info = {"samples": len(ds), "tokens": ds.num_tokens, "shards": len(ds.shards), "bytes": nbytes,
            "bytes_per_token": round(nbytes / ds.num_tokens, 1) if ds.num_tokens else 0,
            "layer_ids": ds.layer_ids, "hidden_size": ds.meta.get("hidden_size"),
            "store_dtype": ds.meta.get("store_dtype"), "model": ds.meta.get("model"), "errors": n_err,
            "partitions": len(part_dirs(output))}
    info.update(_stream_state(output, {r["shard"]: r["bytes"] for r in ds.shards}))
    print(json.dumps(info) if json_out else "\n".join(f"{k:16} {v}" for k, v in info.items()))


def _codecs(ds, max_bytes: int, json_out: bool) -> None:
    """Each codec of vx/store/codec.py on the first max_bytes of the output's stored states."""
    import torch

    from vx.errors import UsageError
    from vx.store.codec import BLOCK, measure
    from vx.store.reader import ShardFile

    parts, n, itemsize = [], 0, None
    for rec in ds.shards:
        if n >= max_bytes:
            break
        h = ShardFile(ds.path / rec["shard"]).tensor("hidden_states")  # [T, L, H] as stored
        itemsize = h.element_size()
        raw = h.contiguous().view(torch.uint8).reshape(-1).numpy()[: max_bytes - n]
        parts.append(raw.tobytes())
        n += raw.size
    if not n:
        raise UsageError(f"{ds.path} holds no stored states to measure")
    data = b"".join(parts)
    rows = measure([data[i:i + BLOCK] for i in range(0, len(data), BLOCK)], itemsize)
    info = {"store_dtype": ds.meta.get("store_dtype"), "measured_bytes": n, "block_bytes": BLOCK, "codecs": rows}
    if json_out:
        print(json.dumps(info))
        return
    print(f"{n / 1e6:.1f} MB of stored {info['store_dtype']} states, {BLOCK >> 10} KiB blocks, one core:")
    for r in rows:
        print(f"  {r['codec']:24s} {r['ratio']:.3f}x  encode {r['encode_gb_s']:.2f} GB/s  decode "
              f"{r['decode_gb_s']:.2f} GB/s  {'lossless' if r['lossless'] else 'NOT LOSSLESS'}")


def _stream_state(output: Path, sizes: dict) -> dict:
    """Whether the extraction has ended, and for follow readers (--retain-gb) what each rank
    consumed and what was dropped."""
    from vx.errors import UsageError
    from vx.store.retention import consumed_by_all, reader_records
    from vx.store.stream import Stream

    st = Stream(str(output))
    try:
        st.refresh()
    except UsageError:  # partitionings mixed by a resumed run: no single stream order
        return {"complete": None}
    info = {"complete": st.complete}
    readers = reader_records(st)
    if readers:
        upto, who = consumed_by_all(readers)
        info["readers"] = {f"rank {r['rank']} of {r['world_size']}": f"{r['consumed']} of {len(st)} shards consumed "
                           f"(epoch {r['epoch']}, batch {r['position']})" for r in sorted(readers, key=lambda r: r["rank"])}
        info["consumed_by_all"] = f"{upto} shards ({who})"
    dropped = st.dropped()
    if dropped:
        info["dropped"] = f"{len(dropped)} shards, {sum(sizes.get(n, 0) for n in dropped) / 1e9:.3f} GB (--retain-gb)"
    return info
