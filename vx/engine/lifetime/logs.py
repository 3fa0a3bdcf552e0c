"""Where vLLM's output goes.

By default the terminal keeps vx's progress bar, vx's own messages and vLLM's warnings from
this process; vLLM's full log (INFO) and everything its engine processes print (their logs,
Triton and NUMA notices, load progress bars, exit diagnostics) go to OUT/logs/vllm.log. The
engine processes inherit the driver's stderr when they are started, so for the engine's start
the driver's stderr is pointed at the log file; after it, the driver's vLLM logger writes INFO
to the file and WARNING and up to the terminal. `-v/--verbose` leaves everything on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

LOG_DIR = "logs"
VLLM_LOG = "vllm.log"


def vllm_log_path(out: Path) -> Path:
    return Path(out) / LOG_DIR / VLLM_LOG


@contextlib.contextmanager
def engine_output(log_file: Path | None, verbose: bool = False):
    """Run the engine's start inside this; see the module docstring."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if verbose or log_file is None:
        yield
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    global _terminal
    sys.stderr.flush()
    saved = _terminal = os.dup(2)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        _terminal = None
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        _split_driver_log(log_file)


_terminal: int | None = None  # the driver's own stderr while an engine starts (its fd 2 is the log then)


def stderr_to_terminal() -> None:
    """Point fd 2 back at the driver's own stderr, if an engine's start has it on the log now: for
    the one line of a driver that leaves during the start (vx/engine/lifetime/liveness.py)."""
    if _terminal is not None:
        sys.stderr.flush()
        os.dup2(_terminal, 2)


def _split_driver_log(log_file: Path) -> None:
    """The driver's vLLM logger from now on: INFO to the file, WARNING and up to the terminal."""
    logger = logging.getLogger("vllm")
    if any(getattr(h, "_vx", False) for h in logger.handlers):
        return
    fmt = next((h.formatter for h in logger.handlers if h.formatter is not None), None)
    for h in logger.handlers:
        h.setLevel(logging.WARNING)
        h.addFilter(_said_by_vx)
    to_file = logging.FileHandler(log_file)
    to_file._vx = True
    to_file.setLevel(logging.DEBUG)
    if fmt is not None:
        to_file.setFormatter(fmt)
    logger.addHandler(to_file)


def _said_by_vx(record: logging.LogRecord) -> bool:
    """The terminal skips vLLM's notice that its engine core exited: vx's own line says which
    process died, how, and what to do (vx/engine/lifetime/liveness.py); the log file keeps it."""
    return "engine core exited unexpectedly" not in record.getMessage()


def without_tokenizer() -> None:
    """vx's engines have no tokenizer (they take token ids; vx/engine/vllm_engine.py,
    vx/engine/generator.py), and vLLM's LLM still warms a chat template up at its start (0.32
    and 0.33): that warning and its traceback say nothing about vx's engines, and stay out of the log."""
    logger = logging.getLogger("vllm.renderers.base")
    if _no_text_warmup not in logger.filters:
        logger.addFilter(_no_text_warmup)


def _no_text_warmup(record: logging.LogRecord) -> bool:
    msg = record.getMessage()  # and its note on each tokenizer-less generation (vx passes the EOS)
    return not msg.startswith(("Chat template warmup failed", "Using None for EOS token id"))
