"""The figures of one run, or of one partition of it, as they stand.

A Meter counts what its job tells it (samples and tokens done, bytes written, bad records) and
asks its sources for the rest (the uploader's bytes and backlog, the device's memory in use) when
a snapshot is taken. Rates are over the last WINDOW seconds, so a run that slows down shows it
within a minute instead of being averaged away; MFU is useful FLOPs (the job's FLOPs per token x
tokens/s) over the peak of the devices the run holds; ETA is the samples left at the recent rate.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque

WINDOW = 30.0  # seconds of recent progress behind each rate


class Meter:
    def __init__(self, total: int | None = None, partition: int | None = None, label: str = "extract",
                 flops_per_token: float | None = None, peak_flops: float | None = None):
        self.total, self.partition, self.label = total, partition, label
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.samples = self.tokens = self.bytes_written = self.bad = self.skipped = 0
        self.started = time.time()
        self.last_advance: float | None = None  # wall time of the last sample done
        self.state = "starting"                  # starting -> running -> done | failed
        self.sources: list = []                  # callables -> dict merged into each snapshot
        self._window: deque = deque([(time.monotonic(), 0, 0)])
        self.totals: dict = {}  # run-long figures for the summary (_track)
        self._util: list[float] = []
        self._lock = threading.Lock()

    def advance(self, samples: int, tokens: int, written_bytes: int | None = None) -> None:
        with self._lock:
            self.samples += samples
            self.tokens += tokens
            if written_bytes is not None:
                self.bytes_written = written_bytes
            now = time.monotonic()
            self._window.append((now, self.samples, self.tokens))
            while len(self._window) > 2 and now - self._window[1][0] > WINDOW:
                self._window.popleft()
        self.last_advance = time.time()
        self.state = "running"

    def set_counts(self, samples: int, tokens: int, bytes_written: int = 0) -> None:
        """Absolute counts (a launcher folding its workers' totals)."""
        self.advance(samples - self.samples, tokens - self.tokens, bytes_written)

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s) over the recent window."""
        with self._lock:
            now = time.monotonic()
            t0, s0, k0 = self._window[0]
            dt = now - t0
            return ((self.samples - s0) / dt, (self.tokens - k0) / dt) if dt > 0.5 else (0.0, 0.0)

    def snapshot(self) -> dict:
        sps, tps = self.rates()
        left = None if self.total is None else max(0, self.total - self.samples - self.skipped)
        snap = {"partition": self.partition, "label": self.label, "state": self.state, "host": socket.gethostname(),
                "pid": os.getpid(), "started": round(self.started, 3), "updated": round(time.time(), 3),
                "last_advance": self.last_advance, "samples": self.samples, "total_samples": self.total,
                "tokens": self.tokens, "bytes_written": self.bytes_written, "bad_records": self.bad,
                "skipped": self.skipped, "samples_per_s": round(sps, 3), "tokens_per_s": round(tps, 1),
                "mfu": mfu(tps, self.flops_per_token, self.peak_flops),
                "eta_s": round(left / sps, 1) if left is not None and sps > 0 else (0.0 if left == 0 else None)}
        for source in self.sources:
            try:
                snap.update(source())
            except Exception:  # a figure that cannot be read now is left out, never fatal
                pass
        self._track(snap)
        return snap

    def _track(self, snap: dict) -> None:
        """The run-long figures of the summary: peak device memory, mean GPU utilisation while
        running, S3 retries."""
        t = self.totals
        if snap.get("device_memory_bytes"):
            t["device_memory_peak_bytes"] = max(t.get("device_memory_peak_bytes", 0), snap["device_memory_bytes"])
        if snap.get("gpu_utilization") is not None and self.state == "running":
            self._util.append(snap["gpu_utilization"])
            t["gpu_utilization_mean"] = round(sum(self._util) / len(self._util), 3)
        if snap.get("upload_retries") is not None:
            t["upload_retries"] = snap["upload_retries"]


def mfu(tokens_per_s: float, flops_per_token: float | None, peak: float | None) -> float | None:
    if not flops_per_token or not peak:
        return None
    return round(tokens_per_s * flops_per_token / peak, 5)


class Ticker:
    """Calls each sink with the meter's snapshot every `every` seconds, on a daemon thread, and
    once more at stop(): the figures keep flowing while the job's own thread is blocked (a step,
    backpressure), and a job that stopped advancing shows it."""

    def __init__(self, meter: Meter, sinks: list, every: float = 1.0):
        self.meter, self.sinks, self.every = meter, sinks, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vx-ticker", daemon=True)

    def start(self) -> "Ticker":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.tick()

    def tick(self, final: bool = False) -> None:
        snap = self.meter.snapshot()
        for sink in self.sinks:
            try:
                sink(snap, final)
            except Exception:
                pass

    def stop(self, state: str | None = None) -> None:
        if state:
            self.meter.state = state
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.tick(final=True)
