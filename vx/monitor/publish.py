"""The figures a job publishes while it runs: wired here from what the job owns (its output, its
error log, its uploader, its model) to the meter, the progress record and the metrics server."""

from __future__ import annotations

from vx.monitor.metrics import serve_metrics


def watch_writer(bar, cfg, out, terms: dict, errors=None, uploader=None, total: int | None = None, label="extract"):
    """A writer's run (a single run, a partition worker): its meter's terms and sources, its
    progress record in its output; returns the metrics server when this process serves one."""
    from vx.monitor.probe import DeviceProbe
    from vx.store.progress_log import ProgressLog

    m = bar.meter
    m.total, m.label = total, label
    m.flops_per_token, m.peak_flops = terms["flops_per_token"], terms["peak_flops"]
    if cfg.partition_index is not None:
        m.partition = cfg.partition_index
    m.sources.append(DeviceProbe())
    if errors is not None:
        m.sources.append(lambda: {"bad_records": errors.count})
    if uploader is not None:
        m.sources.append(uploader.figures)
    bar.add_sink(ProgressLog(out.local, out.target, out.endpoint_url, fence=out.fence))
    server = serve_metrics(cfg.metrics_port, label)  # a launcher's workers have none: the launcher serves
    if server is not None:
        bar.add_sink(server.update)
    return server


def watch_launcher(bar, cfg, terms: dict, label: str = "extract"):
    """A launcher's run: the aggregate meter over its workers' events (vx/launch/workers.py
    Tally) and the metrics server labelled by partition; returns the server or None."""
    from vx.monitor.probe import DeviceProbe

    m = bar.meter
    m.label = label
    m.flops_per_token = terms["flops_per_token"]
    m.peak_flops = terms["peak_flops"]  # mfu_terms(..., engines=the launcher's engines)
    m.sources.append(DeviceProbe())
    m.sources.append(lambda: _sums(bar.parts))
    return serve_metrics(cfg.metrics_port, label)


def _sums(parts: dict) -> dict:
    out = {}
    for key in ("bad_records", "bytes_uploaded", "upload_backlog_bytes", "upload_retries", "bytes_written"):
        vals = [p[key] for p in parts.values() if p.get(key) is not None]
        if vals:
            out[key] = sum(vals)
    return out
