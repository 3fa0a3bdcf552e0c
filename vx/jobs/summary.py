"""What an extraction run reports when it ends: the summary printed (or --json) by `vx extract`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Summary:
    output: str
    backend: str
    samples: int
    tokens: int
    errors: int
    resumed_samples: int
    shards: int
    bytes_written: int
    load_s: float
    warmup_s: float
    extract_s: float
    upload: str | None = None
    uploaded_bytes: int = 0
    upload_mb_s: float = 0.0
    peak_local_bytes: int = 0
    max_model_len: int | None = None  # vllm: the engine's longest request (the longest sample + 1, rounded by the plan)
    hidden_block: int | None = None   # vllm: tokens per block of the hidden-state group, read back from the engine
    engine_plan: str | None = None    # vllm: the memory plan's line (vx/engine/plan.py)
    partitions: list | None = None  # data parallel / Ray: one summary per partition
    balance: dict | None = None     # tokens per partition and their spread
    regenerated: dict | None = None  # --regenerate: the regeneration's summary (vx/jobs/one_pass.py)
    mfu: float | None = None         # over the extraction (vx/monitor/flops.py mfu_terms)
    peak: str | None = None          # the peak it is of
    device: dict | None = None       # device_memory_peak_bytes, gpu_utilization_mean, upload_retries

    def set_mfu(self, terms: dict, meter=None) -> None:
        from vx.monitor.meter import mfu

        self.mfu, self.peak = mfu(self.tokens_per_s, terms["flops_per_token"], terms["peak_flops"]), terms["peak"]
        if meter is not None:
            self.device = dict(meter.totals)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.extract_s if self.extract_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.extract_s if self.extract_s else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(samples_per_s=round(self.samples_per_s, 2), tokens_per_s=round(self.tokens_per_s, 1))
        return d


def combine(cfg, backend: str, results: dict[int, dict], total_s: float, extract_s: float, balance: dict) -> Summary:
    """One Summary for a run of partitions: sums, and per partition its samples, tokens and finish
    time (on Ray also its node and the node of every attempt)."""
    from vx.launch.plan import spread

    parts = [dict(partition=i, **{k: r[k] for k in ("samples", "tokens", "errors", "resumed_samples", "shards",
                                                     "bytes_written", "load_s", "warmup_s", "extract_s")},
                  finished_s=r.get("finished_s"), wall_s=r.get("wall_s"), upload_mb_s=r.get("upload_mb_s"),
                  **({k: r.get(k) for k in ("node", "node_id", "attempts", "attempt_nodes")} if "node" in r else {}))
             for i, r in sorted(results.items())]
    finish = [p["finished_s"] for p in parts if p["finished_s"] is not None]
    starts = [p["finished_s"] - p["extract_s"] for p in parts if p["finished_s"] is not None]
    if finish:  # from the first engine's first sample to the last engine's end (loads excluded)
        extract_s = max(finish) - min(starts)
    tokens = [p["tokens"] for p in parts]
    balance = dict(balance, tokens=tokens, token_spread=round(spread(tokens), 5),
                   finish_spread_s=round(max(finish) - min(finish), 2) if finish else 0.0)
    return Summary(str(cfg.output), backend, *(sum(p[k] for p in parts) for k in
                   ("samples", "tokens", "errors", "resumed_samples", "shards", "bytes_written")),
                   max((p["load_s"] for p in parts), default=0.0), max((p["warmup_s"] for p in parts), default=0.0),
                   extract_s, cfg.upload, sum(r.get("uploaded_bytes", 0) for r in results.values()),
                   upload_rate(results.values()),
                   max((r.get("peak_local_bytes", 0) for r in results.values()), default=0),
                   max((r.get("max_model_len") or 0 for r in results.values()), default=0) or None,
                   partitions=parts, balance=balance)


def upload_rate(partitions) -> float:
    """MB/s of the partitions' uploads, from their own durations (each partition's bytes over its
    rate): the bytes over the time an uploader spent sending them."""
    sent = [(r.get("uploaded_bytes", 0), r.get("upload_mb_s") or 0.0) for r in partitions]
    seconds = sum(b / (mb_s * 1e6) for b, mb_s in sent if b and mb_s)
    return sum(b for b, _ in sent) / seconds / 1e6 if seconds else 0.0
