"""`vx bench`: run bench/throughput.py from a source checkout."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from vx.cli.app import app


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             short_help="Throughput of vx against HF, bare vLLM and vLLM's built-in extraction (a source checkout).")
def bench(
    ctx: typer.Context,
    samples: Annotated[int, typer.Option(help="Real chat samples per mode.")] = 120,
    reps: Annotated[int, typer.Option(help="Interleaved repetitions (medians reported).")] = 3,
    modes: Annotated[Optional[str], typer.Option(help="Subset of hf-naive,hf-hooks,vllm-bare,vllm-builtin,vx-vllm.")] = None,
):
    """Throughput of vx vs HF baselines, bare vLLM and vLLM's built-in extraction (needs a source checkout).

    Examples:

      vx bench

      vx bench --samples 480 --modes vllm-bare,vllm-builtin,vx-vllm --compile eager
    """
    from vx.errors import UsageError

    script = Path(__file__).resolve().parents[2] / "bench" / "throughput.py"
    if not script.exists():
        raise UsageError("vx bench runs bench/throughput.py from a source checkout; none found beside this vx")
    argv = [str(script), "--samples", str(samples), "--reps", str(reps)] + (["--modes", modes] if modes else [])
    sys.argv = argv + list(ctx.args)
    runpy.run_path(str(script), run_name="__main__")
