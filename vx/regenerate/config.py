"""`vx regenerate`'s flat, validated configuration, and the plan of one conversation."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vx.data.generation import Generation, check_generation
from vx.errors import UsageError
from vx.launch.options import Engines


@dataclass
class Conversation:
    id: str
    record: dict
    messages: list[dict]
    todo: list[int]                        # indexes of the assistant turns still to (re)generate
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False


@dataclass
class RegenConfig(Engines, Generation):  # the engine, scale-out and generation options: vx/launch/options.py, vx/data/generation.py
    data: str
    output: Path
    model: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: str | None = None
    messages_field: str = "messages"
    id_field: str = "id"
    commit_every: int = 64                  # conversations per fsynced chunk (and at most 2 s apart)
    endpoint_url: str | None = None
    verbose: bool = False
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
