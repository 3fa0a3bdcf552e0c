"""Option types shared by commands."""

from typing import Annotated, Optional

import typer

OutputDir = Annotated[str, typer.Option("--output", "-o", help="Output directory (created; rerun to resume), or s3://bucket/prefix (staged locally under the vx cache).")]
ModelPath = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Local HF model directory. Default: the embedded tiny hybrid-GDN model.")]
Layers = Annotated[Optional[str], typer.Option(
    help="Comma-separated layer ids; id k = output of decoder layer k (0-based) = HF hidden_states[k+1], "
         "pre-final-norm; or a preset: dflash (the default: 5 ids evenly spaced 1..N-3, 64 layers: 1,16,31,46,61), "
         "speculators-dflash (those and N-1, the verifier's last state speculators trains against), "
         "speculators (speculators' default targets and N-1).")]
Progress = Annotated[Optional[bool], typer.Option(
    "--progress/--no-progress", help="Progress bar on stderr. Default: on when stderr is a terminal.")]


def parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        from vx.errors import UsageError

        raise UsageError(f"--gpus must be comma-separated GPU ids, got {text!r}") from None
