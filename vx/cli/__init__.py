"""The `vx` command: one module per command, each parsing its flags and calling one job;
errors map to exit codes in one place (vx.errors.run_guarded)."""

from __future__ import annotations

import os
import signal
import sys

import typer

from vx.cli import bench, export, extract, inspect, regenerate, selftest, verify  # noqa: F401  (register the commands)
from vx.cli.app import app
from vx.errors import leave, run_guarded


def main(argv: list[str] | None = None) -> int:
    command = typer.main.get_command(app)
    return run_guarded(lambda: command.main(args=argv, prog_name="vx", standalone_mode=False))


def entry() -> None:
    rc = main()
    # The run is over; the interpreter's teardown (thread joins, atexit) is left. A signal landing
    # there leaves at once with the documented code, not a KeyboardInterrupt out of the teardown.
    # (In its last step Python gives the signals back to their default action: a signal then ends
    # the process by itself, which a shell's $? reports as the same 130 / 143.)
    signal.signal(signal.SIGINT, _late_signal)
    signal.signal(signal.SIGTERM, _late_signal)
    if rc in (130, 143):  # interrupted, its cleanup done: leave without the teardown. Python ends a
        # process whose KeyboardInterrupt passed through C++ code running Python (pybind11's exec)
        # by SIGINT itself, handled or not (exit status -2, seen by the fault campaign)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    leave(rc)


def _late_signal(signum, frame) -> None:
    sys.stderr.flush()
    os._exit(143 if signum == signal.SIGTERM else 130)
