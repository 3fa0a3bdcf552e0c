"""vx's error types, and the one place that maps errors to exit codes: 0 ok, 1 runtime failure,
2 usage error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). User errors print one line on
stderr, never a traceback (set VX_DEBUG=1 for one). The CLI and every partition worker run through
run_guarded."""

from __future__ import annotations

import os
import signal
import sys
import threading

import click
import typer


class VxError(Exception):
    """A runtime failure with a message meant for the user (exit code 1, no traceback)."""

    exit_code = 1


class UsageError(VxError):
    """Bad user input: a flag, a path, a layer id, a dataset line under --strict (exit code 2)."""

    exit_code = 2


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
