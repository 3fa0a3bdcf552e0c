"""The options that say how the target writes the assistant turns: one list and one check for
`vx regenerate` and `vx extract --regenerate` (each config keeps them as flat fields)."""

from __future__ import annotations

from vx.errors import UsageError

TURNS = ("all", "last")
# the fields both configs carry, with their defaults; the one-pass mode hands exactly these on
FIELDS = {"turns": "all", "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 1024, "seed": None,
          "drop_truncated": False}


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
