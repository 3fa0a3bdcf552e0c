"""A quick exit for vLLM's engine-core and worker processes.

They are spawned interpreters holding millions of objects (torch, transformers, vLLM); at exit the
interpreter's final garbage collections over them take seconds (py-spy: gc_collect_main), longer
than vLLM's 5 s shutdown grace, so the driver force-kills them and their shared memory is left to
the resource tracker's "leaked" warnings. vx's connector, loaded in both processes, installs
vx.errors.quiet_teardown (what every vx process does at its end) as an exit handler: the
garbage collector off, the heap frozen, stderr quiet; by then vx's writer has closed and fsynced
everything, and the process's memory goes back to the OS with it.

A regeneration's engine core loads no vx code of its own (no connector): `in_spawned_child()`,
called where a vx command's main module loads, installs it there. Python's multiprocessing imports
the parent's main module first in every process it spawns (as __mp_main__; vLLM spawns its engine
core and worker on CPU, and on a GPU once CUDA is up), so the vx command that starts an engine
reaches it (under `python -m vx` too: vx/__main__.py drops its module spec, since multiprocessing
skips a main module named *.__main__). That core's finalisation took ~1.5 s of a core after
vLLM's own shutdown (py-spy, 0.32: gc_collect_main with no Python frame left), beside the
one-pass job's capture.

The same hook gives vLLM's engine core and workers a vx process's quick start
(vx.errors.quiet_startup): no garbage collection while they import torch, transformers and vLLM,
~10 s of a core apiece on CPU, of which the collector's passes over the objects those imports
leave were ~2 s. It comes back where vLLM loads its plugins in them, after those imports
(EngineCore.__init__, the worker's init_worker): vx.engine.patches.register.
"""

from __future__ import annotations

import atexit
import multiprocessing
import sys

_installed = False
ENGINE_PROCESSES = ("EngineCore", "VllmWorker")  # the names vLLM gives them (v1/engine/utils.py, v1/executor/multiproc_executor.py)


def install() -> None:
    global _installed
    if not _installed:
        from vx.errors import quiet_teardown  # here: the vx command imports this module before its signals

        _installed = True
        atexit.register(quiet_teardown)


def in_spawned_child() -> None:
    """install(), while multiprocessing imports a vx command's main module in a process it spawned:
    that import runs as __mp_main__ beside the child's own __main__ (multiprocessing.spawn.prepare).
    In the command's own process __mp_main__ is absent, or (once multiprocessing is imported) an
    alias of __main__: nothing then. In vLLM's engine core and workers, the collector is also off
    until vLLM loads its plugins (the process's name is set before this import runs)."""
    mp_main = sys.modules.get("__mp_main__")
    if mp_main is not None and mp_main is not sys.modules.get("__main__"):
        install()
        if multiprocessing.current_process().name.startswith(ENGINE_PROCESSES):
            from vx.errors import quiet_startup

            quiet_startup()
