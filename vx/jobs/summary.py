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
    regenerated: dict | None = None  # --regenerate: the regeneration's summary (vx/pipeline/one_pass.py)
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
