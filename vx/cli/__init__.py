"""The `vx` command. One place maps errors to exit codes: 0 ok, 1 runtime failure, 2 usage error,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM). User errors print one line on stderr, never a traceback (set VX_DEBUG=1 for one)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import click
import typer

from ..errors import VxError

app = typer.Typer(
    name="vx",
    help="Extract target-layer hidden states from LLMs for speculative-decoding drafters (DFlash, EAGLE-3).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

from . import extract as _extract  # noqa: E402,F401  (registers the command)
from . import bench as _bench  # noqa: E402,F401
from . import inspect as _inspect  # noqa: E402,F401
from . import verify as _verify  # noqa: E402,F401
from . import regenerate as _regenerate  # noqa: E402,F401
from . import selftest as _selftest  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    command = typer.main.get_command(app)
    return run_guarded(lambda: command.main(args=argv, prog_name="vx", standalone_mode=False))


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and Ray send on preemption): the same clean stop as Ctrl-C."""


_terminated = False


def _on_sigterm(signum, frame):
    global _terminated
    _terminated = True
    raise Terminated()


def _interrupted() -> int:
    """Ctrl-C or SIGTERM, however click/typer wrapped it on the way up."""
    print("vx: interrupted; rerun the same command to continue", file=sys.stderr)
    return 143 if _terminated else 130


def run_guarded(body) -> int:
    """Run body() (the CLI, or a partition worker) and map what it raises to an exit code."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc = body()
        if rc == 130:  # typer (standalone_mode=False) returns Ctrl-C as exit code 130
            return _interrupted()
        return rc if isinstance(rc, int) else 0
    except (click.exceptions.Exit, typer.Exit) as e:
        return _interrupted() if e.exit_code == 130 else e.exit_code  # typer turns Ctrl-C into Exit(130)
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except (click.exceptions.Abort, typer.Abort):  # click turns Ctrl-C into Abort
        return _interrupted()
    except KeyboardInterrupt:
        return _interrupted()
    except VxError as e:
        if os.environ.get("VX_DEBUG"):
            raise
        print(f"vx: error: {e}", file=sys.stderr)
        return e.exit_code


def entry() -> None:
    sys.exit(main())
