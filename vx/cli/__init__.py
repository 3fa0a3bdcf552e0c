"""The `vx` command: one module per command, each parsing its flags and calling one job;
errors map to exit codes in one place (vx.errors.run_guarded)."""

from __future__ import annotations

import sys

import typer

from vx.cli import bench, export, extract, inspect, regenerate, selftest, verify  # noqa: F401  (register the commands)
from vx.cli.app import app
from vx.errors import run_guarded


def main(argv: list[str] | None = None) -> int:
    command = typer.main.get_command(app)
    return run_guarded(lambda: command.main(args=argv, prog_name="vx", standalone_mode=False))


def entry() -> None:
    sys.exit(main())
