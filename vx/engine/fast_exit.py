"""A quick exit for vLLM's engine-core and worker processes.

They are spawned interpreters holding millions of objects (torch, transformers, vLLM); at exit the
interpreter's final garbage collections over them take seconds (py-spy: gc_collect_main), longer
than vLLM's 5 s shutdown grace, so the driver force-kills them and their shared memory is left to
the resource tracker's "leaked" warnings. vx's connector, loaded in both processes, installs this:
at exit, garbage collection is switched off and the heap frozen; by then vx's writer has closed
and fsynced everything, and the process's memory goes back to the OS with it. Native extensions
then report the objects they still own as leaks at teardown (nanobind: ~100 lines), so the
process's stderr is closed at that point, as Triton does for its own worker processes.
"""

from __future__ import annotations

import atexit
import gc

_installed = False


def install() -> None:
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_freeze)


def _freeze() -> None:
    gc.disable()
    gc.freeze()
    # Objects left to the OS make native extensions report "leaks" at teardown (nanobind in
    # Triton prints ~100 lines); this process's work and logs are done: its stderr goes quiet.
    import os
    import sys

    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
