"""Target-layer ids.

Layer id k is the output of decoder layer k (0-based), i.e. HF `hidden_states[k + 1]`, the
residual stream before the final norm. DFlash's default for a target of N layers takes
`num_draft_layers` ids evenly spaced from 1 to N - 3 (64 layers -> [1, 16, 31, 46, 61]).

Presets name the layers a trainer needs. speculators trains against the verifier's last hidden
state too (the output of its last decoder layer, id N - 1) and counts the embedding as its layer
0, so its target layer j is vx's j - 1:
- `dflash`: DFlash's 5 (the default);
- `speculators-dflash`: DFlash's 5 and N - 1 (64 layers: 1,16,31,46,61,63);
- `speculators`: speculators' default targets [2, N // 2, N - 3] as vx ids, and N - 1
  (64 layers: 1,31,60,63).
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


PRESETS = ("dflash", "speculators-dflash", "speculators")


def preset_layer_ids(name: str, num_layers: int) -> list[int]:
    """The vx layer ids of a preset (see the module's docstring) for a model of num_layers."""
    last = num_layers - 1
    if name == "dflash":
        return default_layer_ids(num_layers)
    if name == "speculators-dflash":
        return sorted(set(default_layer_ids(num_layers)) | {last})
    if name == "speculators":
        return sorted({j - 1 for j in (2, num_layers // 2, num_layers - 3) if 1 <= j <= num_layers} | {last})
    raise UsageError(f"--layers {name!r} is neither comma-separated ids nor a preset ({', '.join(PRESETS)})")


def resolve_layer_ids(layers: list[int] | str | None, num_layers: int) -> list[int]:
    """--layers (ids, a preset name, or None for the default) for a model of num_layers."""
    if layers is None:
        return default_layer_ids(num_layers)
    if isinstance(layers, str):
        return preset_layer_ids(layers, num_layers)
    return check_layer_ids(layers, num_layers)


def parse_layer_ids(text: str | None) -> list[int] | str | None:
    """'1,16,31' -> [1, 16, 31]; a preset name -> the name; None or '' -> None (the default)."""
    if text is None or not text.strip():
        return None
    if text.strip() in PRESETS:
        return text.strip()
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--layers must be comma-separated integers or a preset ({', '.join(PRESETS)}), "
                         f"got {text!r}") from None
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
