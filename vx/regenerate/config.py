"""`vx regenerate`'s flat, validated configuration, and the plan of one conversation."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vx.data.generation import check_generation
from vx.errors import UsageError


@dataclass
class Conversation:
    id: str
    record: dict
    messages: list[dict]
    todo: list[int]                        # indexes of the assistant turns still to (re)generate
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False


@dataclass
class RegenConfig:
    data: str
    output: Path
    model: str | None = None
    turns: str = "all"                      # all | last
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    seed: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: str | None = None
    messages_field: str = "messages"
    id_field: str = "id"
    drop_truncated: bool = False
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    commit_every: int = 64                  # conversations per fsynced chunk (and at most 2 s apart)
    endpoint_url: str | None = None
    verbose: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1             # engines on this node (vx/regenerate/partitions.py)
    gpus: list[int] | None = None
    num_partitions: int = 1                 # alone: the partitions one after another on one engine
    partition_index: int | None = None      # run exactly this partition (SLURM arrays and the like)
    ray: bool = False
    ray_address: str | None = None
    max_retries: int = 3
    metrics_port: int | None = None         # serve Prometheus metrics here (vx/monitor/metrics.py)
    progress_every: float | None = None     # not a terminal: a progress line every this many s (None: 30)
    plan_file: str | None = None            # internal: the partition plan a launcher computed
    merge: bool = True                      # internal: the last partition done merges the parts (the one-pass
    #                                         launcher merges them itself, once every capture has read its part)

    def __post_init__(self):
        self.output = Path(self.output)
        check_generation(self)
        if self.commit_every < 1:
            raise UsageError(f"--commit-every must be >= 1, got {self.commit_every}")
        from vx.data.chat import check_template_options
        from vx.launch.options import check_engine_options, check_scale_out
        from vx.monitor.metrics import check_options

        check_engine_options(self)
        check_options(self)
        self.template_kwargs = check_template_options(self.chat_template, self.chat_template_kwargs)
        if not (self.num_partitions > 1 and self.partition_index is None and self.data_parallel_size == 1
                and not self.ray and self.gpus is None):  # --num-partitions alone: one engine, in turn
            check_scale_out(self)

    @property
    def launcher(self) -> bool:
        """Partitions run by workers this process starts (data parallel, Ray, or in turn)."""
        return self.partition_index is None and (self.ray or self.num_partitions > 1 or self.data_parallel_size > 1)

    def reading(self):
        """The partition plan's weights: each conversation's tokens as `vx extract` reads it (the
        original assistant turns stand in for the lengths the target will write)."""
        from vx.data.samples import Reading

        template = Path(self.chat_template).read_text() if self.chat_template else None
        return Reading(self.messages_field, "text", self.id_field, template,
                       json.dumps(self.template_kwargs, sort_keys=True))

    def to_json(self) -> dict:
        d = asdict(self)
        d["output"] = str(self.output)
        return d
