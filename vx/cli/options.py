"""Option types shared by commands."""

import functools
import inspect
import types
import typing
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

# the engine, scale-out and reading options `vx extract` and `vx regenerate` share
TensorParallelSize = Annotated[int, typer.Option(help="vllm: GPUs per engine.")]
DataParallelSize = Annotated[int, typer.Option("--data-parallel-size", "--dp", help="Engines on this node, one per GPU group of --tensor-parallel-size (on CPU: each on its share of the cores), over token-balanced partitions.")]
Gpus = Annotated[Optional[str], typer.Option(help="GPU ids for the engines, e.g. 0,1,2,3 (with --tensor-parallel-size 2: 2 engines of 2 GPUs).")]
RayAddress = Annotated[Optional[str], typer.Option(help="Ray cluster address. Default: auto (RAY_ADDRESS, or the cluster started on this node).")]
MaxRetries = Annotated[int, typer.Option(help="ray: times a failed partition is rescheduled (it resumes from what it committed).")]
MessagesField = Annotated[str, typer.Option(help="Record field holding the conversation (OpenAI messages or ShareGPT turns).")]
IdField = Annotated[str, typer.Option(help="Record field holding the sample id (default when absent: the row number).")]
ChatTemplate = Annotated[Optional[str], typer.Option(help="Jinja chat template file to use instead of the tokenizer's.")]
ChatTemplateKwargs = Annotated[Optional[str], typer.Option(help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\' (Qwen3 thinking off).')]
JsonSummary = Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")]


def parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        from vx.errors import UsageError

        raise UsageError(f"--gpus must be comma-separated GPU ids, got {text!r}") from None


GENERATION_HELP = {
    "turns": "all: every assistant turn, in order, on the regenerated history; last: only the final one.",
    "temperature": "Sampling temperature (0: greedy).",
    "top_p": "Nucleus sampling: keep the smallest set of tokens of this total probability.",
    "top_k": "Top-k sampling (0 or -1: off).",
    "max_tokens": "Longest generated turn; a turn cut here is marked truncated.",
    "seed": "Sampling seed (per turn: seed + a hash of id and turn, so reruns and partitions draw the same).",
    "drop_truncated": "Leave out conversations with a turn cut by --max-tokens.",
}


def with_generation(prefix: str = ""):
    """How the target writes the assistant turns (--turns ... --drop-truncated), defined once for
    `vx regenerate` and `vx extract --regenerate`: the options take the place of the command's
    `generation` parameter, which receives them as one vx.data.generation.Generation. prefix
    begins each option's help."""
    from dataclasses import fields

    from vx.data.generation import Generation

    hints = typing.get_type_hints(Generation)  # `int | None` as typer reads it: Optional[int]
    kind = {f.name: Optional[hints[f.name].__args__[0]] if isinstance(hints[f.name], types.UnionType)
            else hints[f.name] for f in fields(Generation)}
    return _group("generation", [_option(f.name, Annotated[kind[f.name], typer.Option(help=prefix + GENERATION_HELP[f.name])],
                                         f.default) for f in fields(Generation)], Generation)


def with_engines():
    """The engine and scale-out options every job that runs engines takes alike (--tensor-parallel-size,
    --data-parallel-size, --gpus, --ray-address, --max-retries): in place of the command's `engines`
    parameter, which receives them as a dict of its config's fields (--gpus parsed)."""
    return _group("engines", [_option("tensor_parallel_size", TensorParallelSize, 1),
                              _option("data_parallel_size", DataParallelSize, 1), _option("gpus", Gpus, None),
                              _option("ray_address", RayAddress, None), _option("max_retries", MaxRetries, 3)],
                  lambda **kw: dict(kw, gpus=parse_gpus(kw["gpus"])))


def _option(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _group(placeholder: str, options: list[inspect.Parameter], make):
    """A decorator: `options` in the command's parameters where its `placeholder` parameter is, and
    handed to it as that parameter, make(**their values). typer reads the signature this gives."""
    def wrap(command):
        sig = inspect.signature(command, eval_str=True)
        params = []
        for p in sig.parameters.values():
            params += options if p.name == placeholder else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(command, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
        def run(**kwargs):
            group = make(**{o.name: kwargs.pop(o.name) for o in options})
            return command(**kwargs, **{placeholder: group})

        run.__signature__ = sig.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run
    return wrap
