"""A quick exit for vLLM's engine-core and worker processes.

They are spawned interpreters holding millions of objects (torch, transformers, vLLM); at exit the
interpreter's final garbage collections over them take seconds (py-spy: gc_collect_main), longer
than vLLM's 5 s shutdown grace, so the driver force-kills them and their shared memory is left to
the resource tracker's "leaked" warnings. vx's connector, loaded in both processes, installs
vx.errors.quiet_teardown (what every vx process does at its end) as an exit handler: the
garbage collector off, the heap frozen, stderr quiet; by then vx's writer has closed and fsynced
everything, and the process's memory goes back to the OS with it.
"""

from __future__ import annotations

import atexit

from vx.errors import quiet_teardown

_installed = False


def install() -> None:
    global _installed
    if not _installed:
        _installed = True
        atexit.register(quiet_teardown)
