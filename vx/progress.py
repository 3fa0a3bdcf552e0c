"""Progress on stderr (rich): samples/s, tokens/s, MB/s written, ETA. Silent when not a TTY
unless forced, so logs stay clean; the summary always goes to stdout."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)


class RunProgress:
    def __init__(self, total: int | None, enabled: bool | None = None, label: str = "extract"):
        self.console = Console(stderr=True)
        self.label = label  # regenerate: conversations/s and generated tokens/s, no bytes
        enabled = self.console.is_terminal if enabled is None else enabled
        self.samples = self.tokens = 0
        self.start = time.perf_counter()
        self._bar = None
        self.status = None  # optional callable -> str appended to the bar (the S3 uploader's figures)
        if enabled:
            self._bar = Progress(
                TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task(label, total=total, rate="")
            self._bar.start()

    def advance(self, samples: int, tokens: int, written_bytes: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if self._bar is not None:
            dt = max(time.perf_counter() - self.start, 1e-9)
            if self.label == "regenerate":
                rate = f"{self.samples / dt:,.1f} conversations/s  {self.tokens / dt:,.0f} generated tok/s"
            else:
                rate = (f"{self.samples / dt:,.1f} samples/s  {self.tokens / dt:,.0f} tok/s  "
                        f"{written_bytes / dt / 1e6:,.1f} MB/s")
            if self.status is not None:
                rate += "  " + self.status()
            self._bar.update(self._task, advance=samples, rate=rate)

    def skip(self, samples: int) -> None:
        """Lines that produce no compute (bad lines, already committed)."""
        if self._bar is not None and samples:
            self._bar.update(self._task, advance=samples)

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class EventProgress:
    """RunProgress's interface for a partition worker: JSON progress lines on a stream (its
    stdout, read by the launcher), at most every `every` seconds and once at the end."""

    def __init__(self, stream, partition: int, every: float = 0.5):
        self.stream, self.partition, self.every = stream, partition, every
        self.samples = self.tokens = self.skipped = 0
        self.status = None
        self._last = 0.0

    def emit(self, event: str = "progress", **extra) -> None:
        import json

        rec = {"vx": event, "partition": self.partition, "samples": self.samples, "tokens": self.tokens,
               "skipped": self.skipped, **extra}
        self.stream.write(json.dumps(rec) + "\n")
        self.stream.flush()
        self._last = time.monotonic()

    def advance(self, samples: int, tokens: int, written_bytes: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if time.monotonic() - self._last >= self.every:
            self.emit()

    def skip(self, samples: int) -> None:
        self.skipped += samples

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.emit()
