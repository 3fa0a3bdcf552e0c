"""Target-layer ids.

Layer id k is the output of decoder layer k (0-based), i.e. HF `hidden_states[k + 1]`, the
residual stream before the final norm. DFlash's default for a target of N layers takes
`num_draft_layers` ids evenly spaced from 1 to N - 3 (64 layers -> [1, 16, 31, 46, 61]).
"""

from __future__ import annotations

from vx.errors import UsageError


def default_layer_ids(num_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash's rule: evenly spaced from 1 to num_layers - 3 (duplicates dropped on tiny models)."""
    if num_layers < 1:
        raise UsageError(f"model has {num_layers} decoder layers")
    if num_draft_layers == 1 or num_layers < 5:
        return [num_layers // 2] if num_draft_layers == 1 else list(range(num_layers))[:num_draft_layers]
    start, end = 1, num_layers - 3
    span = end - start
    ids = [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return sorted(set(ids))


def parse_layer_ids(text: str | None) -> list[int] | None:
    """'1,16,31' -> [1, 16, 31]; None or '' -> None (use the default)."""
    if text is None or not text.strip():
        return None
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--layers must be comma-separated integers, got {text!r}") from None
    return ids


def check_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """Validate ids against the model's layer count; returns them sorted, unique."""
    if not ids:
        raise UsageError("--layers is empty")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise UsageError(
            f"layer ids {bad} out of range: the model has {num_layers} decoder layers, valid ids are "
            f"0..{num_layers - 1} (id k = output of decoder layer k = HF hidden_states[k+1])"
        )
    if len(set(ids)) != len(ids):
        raise UsageError(f"duplicate layer ids in {ids}")
    return sorted(ids)
