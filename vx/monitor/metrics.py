"""`--metrics-port PORT`: the run's figures as Prometheus metrics over HTTP, labelled by partition.

The server holds the latest snapshot of each partition (a single run is partition "0") and a
collector turns them into metric families on each scrape, so counters are the writers' own
totals (a restarted partition's reset is one Prometheus handles) and nothing is counted twice.
docs/commands.md has a scrape config and the queries that answer "is it running, how fast, when
will it end".
"""

from __future__ import annotations

import threading

# name, kind, help, snapshot key
FIGURES = [
    ("vx_samples", "counter", "Samples extracted by this run (their states handed to the shard writer).", "samples"),
    ("vx_tokens", "counter", "Tokens of the samples extracted by this run.", "tokens"),
    ("vx_bytes_written", "counter", "Shard bytes written by this run.", "bytes_written"),
    ("vx_bytes_uploaded", "counter", "Shard bytes uploaded to S3 by this run.", "bytes_uploaded"),
    ("vx_upload_retries", "counter", "S3 requests retried (throttling, 5xx, dropped connections).", "upload_retries"),
    ("vx_bad_records", "counter", "Dataset records reported in errors.jsonl by this run.", "bad_records"),
    ("vx_total_samples", "gauge", "Samples this run has to do (after those committed before).", "total_samples"),
    ("vx_samples_per_second", "gauge", "Samples per second over the last 30 s.", "samples_per_s"),
    ("vx_tokens_per_second", "gauge", "Tokens per second over the last 30 s.", "tokens_per_s"),
    ("vx_mfu", "gauge", "Model FLOPs utilisation over the last 30 s (useful FLOPs / bf16 dense peak).", "mfu"),
    ("vx_eta_seconds", "gauge", "Seconds left at the recent rate.", "eta_s"),
    ("vx_upload_backlog_bytes", "gauge", "Committed shard bytes not yet uploaded.", "upload_backlog_bytes"),
    ("vx_local_shard_bytes", "gauge", "Shard bytes on local disk.", "local_bytes"),
    ("vx_requests_in_flight", "gauge", "Requests submitted to the engine and not yet finished.", "in_flight"),
    ("vx_writer_queue_bytes", "gauge", "Captured bytes handed to the shard writer, not yet committed.",
     "writer_queue_bytes"),
    ("vx_device_memory_bytes", "gauge", "Device memory in use (GPU: NVML; CPU: the engine's resident memory).",
     "device_memory_bytes"),
    ("vx_gpu_utilization", "gauge", "GPU utilisation (NVML, 0..1) of the run's GPUs.", "gpu_utilization"),
    ("vx_last_progress_timestamp_seconds", "gauge", "Unix time of the last sample extracted.", "last_advance"),
    ("vx_started_timestamp_seconds", "gauge", "Unix time the run started.", "started"),
]
STATES = ("starting", "running", "done", "failed")


def check_options(cfg) -> None:
    """--metrics-port and --progress-every, for extract and regenerate alike."""
    from vx.errors import UsageError

    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be a TCP port (0..65535; 0: any free one), got {cfg.metrics_port}")
    if cfg.progress_every is not None and cfg.progress_every < 0:
        raise UsageError(f"--progress-every must be >= 0 seconds (0: no lines), got {cfg.progress_every}")


class MetricsServer:
    def __init__(self, port: int, job: str = "extract", addr: str = "0.0.0.0"):
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        self.job = job
        self.latest: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        try:
            self.server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            from vx.errors import UsageError

            raise UsageError(f"--metrics-port {port}: cannot listen ({e.strerror or e})") from None
        self.port = self.server.server_port

    def update(self, snap: dict, final: bool = False) -> None:
        """A sink of vx.monitor.meter.Ticker, or a launcher's fold of a worker's event."""
        key = "0" if snap.get("partition") is None else str(snap["partition"])
        with self._lock:
            self.latest[key] = dict(snap)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            snaps = dict(self.latest)
        for name, kind, help_, key in FIGURES:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_,
                                                                                    labels=["job", "partition"])
            for part, s in sorted(snaps.items()):
                if s.get(key) is not None:
                    fam.add_metric([self.job, part], float(s[key]))
            yield fam
        up = GaugeMetricFamily("vx_partition_state", "1 for the partition's current state.",
                               labels=["job", "partition", "state"])
        for part, s in sorted(snaps.items()):
            for st in STATES:
                up.add_metric([self.job, part, st], 1.0 if s.get("state") == st else 0.0)
        yield up

    def describe(self):
        return []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(port: int | None, job: str) -> MetricsServer | None:
    """--metrics-port: the server (its URL on stderr), or None."""
    if port is None:
        return None
    import os
    import sys

    server = MetricsServer(port, job=job)
    print(f"vx: metrics on http://{os.uname().nodename}:{server.port}/metrics", file=sys.stderr, flush=True)
    return server
