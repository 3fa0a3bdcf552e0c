"""The options that say how the target writes the assistant turns: defined once for `vx
regenerate` and `vx extract --regenerate` (both configs are a Generation), with one check."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vx.errors import UsageError

TURNS = ("all", "last")


@dataclass(kw_only=True)
class Generation:
    turns: str = "all"                       # all: every assistant turn, in order; last: only the final one
    temperature: float = 0.0                 # 0: greedy
    top_p: float = 1.0
    top_k: int = -1                          # 0 or -1: off
    max_tokens: int = 1024                   # longest generated turn
    seed: int | None = None                  # per turn: seed + a hash of id and turn
    drop_truncated: bool = False             # leave out conversations with a turn cut by max_tokens


# the fields with their defaults; the one-pass mode hands exactly these on to its regeneration
FIELDS = {f.name: f.default for f in fields(Generation)}


def check_generation(cfg) -> None:
    """One line for the first bad generation option of a config carrying FIELDS."""
    if cfg.turns not in TURNS:
        raise UsageError(f"--turns must be {' or '.join(TURNS)}, got {cfg.turns!r}")
    if cfg.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k < -1:
        raise UsageError(f"--top-k must be >= 1, or 0 or -1 for off, got {cfg.top_k}")
    if cfg.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.seed is not None and cfg.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {cfg.seed}")


def generation_json(cfg) -> dict:
    return {k: getattr(cfg, k) for k in FIELDS}


@dataclass
class Conversation:
    """One conversation as `vx regenerate` plans it: the assistant turns still to (re)generate."""
    id: str
    record: dict
    messages: list[dict]
    todo: list[int]                        # indexes of the assistant turns still to (re)generate
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False
