"""The live line of a run on stderr, and a partition worker's progress events.

On a terminal: a rich bar per run (and one per partition under a launcher) with samples done of
total, samples/s and tokens/s over the last 30 s, MFU, device memory in use, bytes waiting for
upload, bad records and ETA. Not on a terminal (a batch job's log): one such line every
`every` seconds once the first sample is done (the engine's start is in its own log), and
nothing for runs shorter than that. --no-progress: nothing. The summary
always goes to stdout. The figures come from a Meter (vx/monitor/meter.py), refreshed once a
second by a Ticker that also feeds the job's other sinks (the progress record in the output,
--metrics-port).
"""

from __future__ import annotations

import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from vx.monitor.meter import Meter, Ticker

EVERY = 30.0  # seconds between progress lines when stderr is not a terminal


def _every(every: float | None) -> float:
    if every is not None:
        return every
    return float(os.environ.get("VX_PROGRESS_EVERY", EVERY))


def _bytes(n) -> str:
    return "-" if n is None else f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _eta(s) -> str:
    if s is None:
        return "ETA -"
    s = int(s)
    return f"ETA {s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def figures(snap: dict, label: str) -> str:
    """One run's (or partition's) figures as the live line shows them."""
    unit, tok = ("conversations", "generated tok/s") if label == "regenerate" else ("samples", "tok/s")
    parts = [f"{snap['samples_per_s']:,.1f} {unit}/s", f"{snap['tokens_per_s']:,.0f} {tok}"]
    if snap.get("mfu") is not None:
        parts.append(f"MFU {snap['mfu']:.1%}")
    if snap.get("gpu_utilization") is not None:
        parts.append(f"GPU {snap['gpu_utilization']:.0%}")
    if snap.get("device_memory_bytes"):
        parts.append(f"mem {_bytes(snap['device_memory_bytes'])}")
    if snap.get("upload_backlog_bytes") is not None:
        parts.append(f"upload backlog {_bytes(snap['upload_backlog_bytes'])}")
    if snap.get("bad_records"):
        parts.append(f"{snap['bad_records']:,} bad")
    parts.append(_eta(snap.get("eta_s")))
    return "  ".join(parts)


class _Reporter:
    """What RunProgress and EventProgress share: a meter, and the ticker that feeds its sinks."""

    meter: Meter
    ticker: Ticker

    @property
    def samples(self) -> int:
        return self.meter.samples

    @property
    def tokens(self) -> int:
        return self.meter.tokens

    def add_sink(self, sink) -> None:
        """sink(snapshot, final) is called each second and at the end (vx/monitor/meter.py Ticker)."""
        self.ticker.sinks.append(sink)

    def emit(self, event: str = "progress", **extra) -> None:
        """An event for a launcher reading this process (EventProgress); nothing on a terminal."""


class RunProgress(_Reporter):
    def __init__(self, total: int | None, enabled: bool | None = None, label: str = "extract",
                 every: float | None = None):
        self.console = Console(stderr=True)
        self.label = label  # regenerate: conversations/s and generated tokens/s, no bytes
        self.meter = Meter(total, label=label)
        self.parts: dict = {}  # partition -> its latest snapshot (a launcher's workers)
        self._tasks: dict = {}
        self._snap = self.meter.snapshot()
        self._bar = None
        self._lines = enabled is None and not self.console.is_terminal
        self._every, self._last_line, self._printed = _every(every), None, False
        if enabled is None:
            enabled = self.console.is_terminal
        if enabled:
            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), console=self.console, transient=False)
            self._task = self._bar.add_task(label, total=total, rate="")
            self._bar.start()
        self.ticker = Ticker(self.meter, [self._show]).start()


    def advance(self, samples: int, tokens: int, written_bytes: int | None = None) -> None:
        self.meter.advance(samples, tokens, written_bytes)
        if self._bar is not None:
            self._bar.update(self._task, advance=samples)

    def skip(self, samples: int) -> None:
        """Lines that produce no compute (bad lines, already committed)."""
        self.meter.skipped += samples
        if self._bar is not None and samples:
            self._bar.update(self._task, advance=samples)

    def partition(self, key, snap: dict) -> None:
        """A launcher's worker reported: its row on the terminal, its figures in the log line."""
        self.parts[key] = snap
        if self._bar is not None:
            if key not in self._tasks:
                self._tasks[key] = self._bar.add_task(f"  partition {key}", total=snap.get("total_samples"), rate="")
            self._bar.update(self._tasks[key], completed=snap.get("samples", 0) + snap.get("skipped", 0),
                             total=snap.get("total_samples"), rate=figures(snap, self.label))

    def _show(self, snap: dict, final: bool) -> None:
        self._snap = snap
        if self._bar is not None:
            self._bar.update(self._task, rate=figures(snap, self.label))
        elif self._lines and self._last_line is None:
            if snap["state"] == "running":  # the first line comes `every` s after the first sample
                self._last_line = time.monotonic()
        elif self._lines and (time.monotonic() - self._last_line >= self._every > 0 or (final and self._printed)):
            self._last_line, self._printed = time.monotonic(), True
            total = f"/{snap['total_samples']:,}" if snap.get("total_samples") is not None else ""
            line = f"{self.label}: {snap['samples'] + snap['skipped']:,}{total}  {figures(snap, self.label)}"
            for key, p in sorted(self.parts.items()):
                line += f"  | p{key} {p['samples']:,} {p['samples_per_s']:,.1f}/s" + (
                    f" MFU {p['mfu']:.1%}" if p.get("mfu") is not None else "")
            print(line, file=sys.stderr, flush=True)

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def close(self, state: str = "done") -> None:
        self.ticker.stop(state)
        if self._bar is not None:
            self._bar.stop()


class EventProgress(_Reporter):
    """RunProgress's interface for a partition worker: JSON progress lines on a stream (its
    stdout, read by the launcher) carrying its Meter's snapshot, every `every` seconds and once
    at the end."""

    def __init__(self, stream, partition: int, every: float = 1.0):
        import threading

        self.stream, self.partition = stream, partition
        self._lock = threading.Lock()  # the ticker's events and the summary: whole lines, never mixed
        self.meter = Meter(None, partition=partition)
        self.parts: dict = {}
        self.ticker = Ticker(self.meter, [self._send], every=every).start()


    def _send(self, snap: dict, final: bool) -> None:
        self.emit("progress", **snap)

    def emit(self, event: str = "progress", **extra) -> None:
        import json

        rec = {"vx": event, "partition": self.partition, "samples": self.meter.samples,
               "tokens": self.meter.tokens, "skipped": self.meter.skipped, **extra}
        with self._lock:
            self.stream.write(json.dumps(rec) + "\n")
            self.stream.flush()

    def advance(self, samples: int, tokens: int, written_bytes: int | None = None) -> None:
        self.meter.advance(samples, tokens, written_bytes)

    def skip(self, samples: int) -> None:
        self.meter.skipped += samples

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def close(self, state: str = "done") -> None:
        self.ticker.stop(state)
