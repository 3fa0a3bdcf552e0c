"""Option types shared by commands."""

from typing import Annotated, Optional

import typer

OutputDir = Annotated[str, typer.Option("--output", "-o", help="Output directory (created; rerun to resume), or s3://bucket/prefix (staged locally under the vx cache).")]
ModelPath = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Local HF model directory. Default: the embedded tiny hybrid-GDN model.")]
Layers = Annotated[Optional[str], typer.Option(
    # "\\[": typer renders help as Rich markup, which took "[k+1]" for a style and dropped it
    help="Comma-separated layer ids; id k = output of decoder layer k (0-based) = HF hidden_states\\[k+1], "
         "pre-final-norm; or a preset: dflash (the default: 5 ids evenly spaced 1..N-3, 64 layers: 1,16,31,46,61), "
         "speculators-dflash (those and N-1, the verifier's last state speculators trains against), "
         "speculators (speculators' default targets and N-1).")]
Progress = Annotated[Optional[bool], typer.Option(
    "--progress/--no-progress", help="Live progress on stderr: done/total, rate over the last 30 s, MFU, device memory, upload backlog, bad records, ETA. Default: a bar on a terminal, else a line every --progress-every seconds; --no-progress: none.")]
ProgressEvery = Annotated[Optional[float], typer.Option(
    help="When stderr is not a terminal (a batch job's log): one progress line every this many seconds (0: none). Default 30.")]
MetricsPort = Annotated[Optional[int], typer.Option(
    help="Serve Prometheus metrics on this TCP port (http://HOST:PORT/metrics; 0: any free port, logged): samples, tokens, bytes written and uploaded, retries, bad records, rates, MFU, ETA, queue depths, upload backlog, device memory, per partition. See docs/monitoring.md.")]


def parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        from vx.errors import UsageError

        raise UsageError(f"--gpus must be comma-separated GPU ids, got {text!r}") from None


class _Generation:
    """How the target writes the assistant turns: `vx regenerate`'s options, and `vx extract`'s
    with --regenerate (their help says so there)."""

    def __init__(self, prefix: str = ""):
        self.Turns = Annotated[str, typer.Option(help=prefix + "all: every assistant turn, in order, on the regenerated history; last: only the final one.")]
        self.Temperature = Annotated[float, typer.Option(help=prefix + "Sampling temperature (0: greedy).")]
        self.TopP = Annotated[float, typer.Option(help=prefix + "Nucleus sampling: keep the smallest set of tokens of this total probability.")]
        self.TopK = Annotated[int, typer.Option(help=prefix + "Top-k sampling (0 or -1: off).")]
        self.MaxTokens = Annotated[int, typer.Option(help=prefix + "Longest generated turn; a turn cut here is marked truncated.")]
        self.Seed = Annotated[Optional[int], typer.Option(help=prefix + "Sampling seed (per turn: seed + a hash of id and turn, so reruns and partitions draw the same).")]
        self.DropTruncated = Annotated[bool, typer.Option(help=prefix + "Leave out conversations with a turn cut by --max-tokens.")]


Generation = _Generation()
RegenerateGeneration = _Generation("--regenerate: ")
