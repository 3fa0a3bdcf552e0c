"""The typer app every command module registers itself on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="vx",
    help="Extract target-layer hidden states from LLMs for speculative-decoding drafters (DFlash, EAGLE-3).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
