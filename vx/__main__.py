"""`python -m vx` and the `vx` command. The first thing either does is take SIGINT and SIGTERM: a
signal while the command line's modules load (~0.5 s; a scheduler's kill as the job starts) ends
it with the documented code and line instead of Python's default (killed by the signal, nothing
said; or a KeyboardInterrupt traceback). Nothing has started then, so there is nothing to clean up;
vx.errors.run_guarded takes the signals over before any work."""

import os
import signal

from vx.engine.lifetime.fast_exit import in_spawned_child

in_spawned_child()  # a process vLLM spawned from this command imports this module first: its quick exit


def _before_start(signum, frame) -> None:
    os.write(2, b"vx: interrupted; rerun the same command to continue\n")
    os._exit(143 if signum == signal.SIGTERM else 130)


def run() -> None:
    signal.signal(signal.SIGINT, _before_start)
    signal.signal(signal.SIGTERM, _before_start)  # last: caught SIGTERM means both are vx's
    from vx.errors import quiet_startup

    quiet_startup()
    from vx.cli import entry

    entry()


if __name__ == "__main__":
    # `python -m vx`: the processes multiprocessing spawns (vLLM's engine core and workers) skip a
    # main module named *.__main__ (CPython's multiprocessing.spawn._fixup_main_from_name), so they
    # would never run in_spawned_child() above: no quick start, no quick exit. Without a spec they
    # run this file by its path first, as they run the `vx` script.
    __spec__ = None
    run()
