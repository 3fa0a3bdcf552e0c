"""vx's error types, and the one place that maps errors to exit codes: 0 ok, 1 runtime failure,
2 usage error, 3 the engine died (committed work is kept: rerun to continue), 4 another writer
took the S3 output over (its samples are that writer's to write), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM). User errors print one line on
stderr, never a traceback (set VX_DEBUG=1 for one). The CLI and every partition worker run through
run_guarded."""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import threading

import click
import typer

# click's classes, and those of the click that typer >= 0.17 vendors as typer._click
_CLICKS = [click.exceptions]
try:
    import typer._click.exceptions as _typer_click

    _CLICKS.append(_typer_click)
except ImportError:
    pass
_EXITS = (click.exceptions.Exit, typer.Exit)  # typer's own Exit and Abort live in typer.exceptions
_ABORTS = (click.exceptions.Abort, typer.Abort)
_CLICK_ERRORS = tuple(m.ClickException for m in _CLICKS)


class VxError(Exception):
    """A runtime failure with a message meant for the user (exit code 1, no traceback)."""

    exit_code = 1


class UsageError(VxError):
    """Bad user input: a flag, a path, a layer id, a dataset line under --strict (exit code 2)."""

    exit_code = 2


class EngineDied(VxError):
    """An engine vx started died (or stopped answering): exit code 3, committed work is kept."""

    exit_code = 3


class OwnershipLost(VxError):
    """A newer writer took this writer's S3 prefix (vx/store/fence.py): it stopped before writing
    more, and the owner writes its samples (exit code 4)."""

    exit_code = 4


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and Ray send on preemption): the same clean stop as Ctrl-C."""


_terminated = False
_sigint = False  # Ctrl-C arrived: what fails after it is its consequence, not a bug to show


def _on_sigterm(signum, frame):
    global _terminated
    _terminated = True
    raise Terminated()


def stop_requested() -> bool:
    """Whether SIGTERM or Ctrl-C reached this process: a job whose step came back normally anyway
    (a library caught what the handler raised) stops there instead of going on."""
    return _terminated or _sigint


def raise_if_stopped() -> None:
    """Called at each turn of a main loop: a stop whose KeyboardInterrupt was swallowed is still a
    stop. The handlers raise it wherever the main thread is, and where that is a finalizer run by
    the garbage collector (`__del__`), Python prints "Exception ignored" and goes on (the fault
    campaign's trial 86 of seed 51: SIGINT to a --dp 2 launcher, exit 0 at the run's end)."""
    if stop_requested():
        raise KeyboardInterrupt


def _quiet_unraisable(unraisable) -> None:
    """A stop raised inside a finalizer is taken up by raise_if_stopped, not printed as a traceback."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _on_sigint(signum, frame):
    global _sigint
    _sigint = True
    raise KeyboardInterrupt


def _interrupted() -> int:
    """Ctrl-C or SIGTERM, however click/typer wrapped it on the way up."""
    print("vx: interrupted; rerun the same command to continue", file=sys.stderr)
    return 143 if _terminated else 130


def run_guarded(body) -> int:
    """Run body() (the CLI, or a partition worker) and map what it raises to an exit code."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _quiet_unraisable
    try:
        rc = body()
        if rc == 130:  # typer (standalone_mode=False) returns Ctrl-C as exit code 130
            return _interrupted()
        return rc if isinstance(rc, int) else 0
    except _EXITS as e:
        return _interrupted() if e.exit_code == 130 else e.exit_code  # typer turns Ctrl-C into Exit(130)
    except _CLICK_ERRORS as e:
        e.show()
        return e.exit_code
    except _ABORTS:  # click turns Ctrl-C into Abort
        return _interrupted()
    except KeyboardInterrupt:
        return _interrupted()
    except (VxError, OSError) as e:  # OSError: a disk or the network failed where no layer named it
        if _terminated or _sigint:  # a signal to the process group: the engine died of it, the stop is the news
            return _interrupted()
        if os.environ.get("VX_DEBUG"):
            raise
        vx_error = isinstance(e, VxError)
        print(f"vx: error: {e if vx_error else os_error_line(e)}", file=sys.stderr)
        return e.exit_code if vx_error else 1
    except Exception:
        if _terminated or _sigint:  # what the stop broke on its way out (a library's import, half done)
            return _interrupted()
        raise


def os_error_line(e: OSError) -> str:
    what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    fix = "free space" if e.errno == errno.ENOSPC else "fix the cause"
    return f"{what}; what was committed is kept: {fix} and rerun the same command to continue"


_starting = False  # quiet_startup() ran and startup_over() did not yet


def quiet_startup(backstop_s: float = 120.0) -> None:
    """A vx process's start (the CLI, a partition worker, the engine core and workers of an engine
    vx started: vx/engine/lifetime/fast_exit.py): the garbage collector is off while torch,
    transformers and vLLM load. They create millions of objects that live as long as the process,
    and collecting over them as they load is ~25% of their import time (measured: 10.5 -> 7.8 s of
    CPU for vLLM's engine modules). It comes back, with those objects frozen out of its reach,
    once vLLM loads its plugins in the process, an engine or a model is ready or a launcher starts
    its loop (startup_over()), and after backstop_s in any case: a long run never goes without it."""
    global _starting
    gc.disable()
    _starting = True
    timer = threading.Timer(backstop_s, startup_over)
    timer.daemon = True
    timer.start()


def startup_over() -> None:
    """The start-up is over: its garbage is collected once, what lives on is frozen (never scanned
    again) and the collector is back on. No-op in a process that did not call quiet_startup() (vx
    used as a library). After imports_over() the collection passes over what was made since."""
    global _starting
    if _starting:
        _starting = False
        gc.collect()  # the start-up's finalizers (__del__) run here: a stop may be swallowed in one, and
        gc.freeze()  # the caller takes it up (raise_if_stopped)
        gc.enable()


def imports_over() -> None:
    """The start-up's imports are done: what exists now is frozen uncollected, so that
    startup_over()'s collection passes over what was made since (a model's load: thousands of
    objects; where vLLM loads its plugins or a launcher starts its loop: none), not over the ~1 M
    the imports left (0.4-0.7 s of a core per process for torch, transformers and vLLM, measured in
    the HF backend, vLLM's engine core, its worker and the driver). Their garbage, cycles the
    import machinery and the libraries' module code leave (~20k objects, ~13 MB), stays."""
    if _starting:
        gc.freeze()


def quiet_teardown() -> None:
    """The interpreter's teardown, once a process's work is done and said. It would run the garbage
    collector over every object torch, transformers and vLLM created (1.5-4 s per process; py-spy:
    in finalisation, after the result is printed): the collector is switched off and the heap
    frozen. Objects still free by reference count (files flush and close); what is left goes back
    to the OS with the process. Native extensions then report the objects they still own as leaks
    (nanobind in Triton, ~100 lines): stderr goes quiet first."""
    gc.disable()
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`vx inspect | head`), a closed stream
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def leave(rc: int) -> None:
    """End this process (a `vx` command, a partition worker) with rc, its result printed: atexit
    handlers and thread joins still run, the garbage collector does not (quiet_teardown)."""
    quiet_teardown()
    sys.exit(rc)


def exit_interrupted() -> None:
    """Leave at once after Ctrl-C or SIGTERM that the main thread cannot take up (a library caught
    what the handler raised and went back to a wait of its own): run_guarded's line and code."""
    sys.stdout.flush()
    rc = _interrupted()
    sys.stderr.flush()
    os._exit(rc)


def exit_now(e: VxError) -> None:
    """Leave at once (a thread's backstop when the main thread cannot be reached): the line and
    exit code run_guarded would give."""
    sys.stdout.flush()
    rc = _interrupted() if _terminated else e.exit_code
    if not _terminated:
        print(f"vx: error: {e}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(rc)
