"""Where the target model comes from: a local HF directory, or the embedded tiny default."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vx.errors import UsageError


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    num_layers: int
    hidden_size: int
    model_type: str
    vision_language: bool  # checkpoint in the VL layout (text_config inside config.json)
    fingerprint: str       # sha256 of config.json: the same model wherever its directory lives
    vocab_size: int | None = None  # embedding rows (often more than the tokenizer's entries)
    max_position_embeddings: int | None = None  # the model's own longest sequence


def resolve_model(model: str | None) -> Path:
    """`None` -> the embedded tiny model (built on first use); else a local HF model directory."""
    if model is None:
        from vx.data.tiny import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise UsageError(f"--model {model!r} is not a local directory. vx never downloads: pass the path "
                         "of a local HF checkpoint (config.json + *.safetensors + tokenizer files)")
    if not (path / "config.json").exists():
        raise UsageError(f"--model {model!r} has no config.json; is it an HF checkpoint directory?")
    return path.resolve()


def model_info(path: Path) -> ModelInfo:
    raw = (path / "config.json").read_bytes()
    cfg = json.loads(raw)
    text = cfg.get("text_config") or cfg
    try:
        return ModelInfo(path, int(text["num_hidden_layers"]), int(text["hidden_size"]),
                         text.get("model_type", cfg.get("model_type", "?")), "text_config" in cfg,
                         hashlib.sha256(raw).hexdigest()[:16], text.get("vocab_size", cfg.get("vocab_size")),
                         text.get("max_position_embeddings", cfg.get("max_position_embeddings")))
    except KeyError as e:
        raise UsageError(f"{path}/config.json lacks {e.args[0]!r}") from None


_TOKENIZERS: dict[tuple, object] = {}


def load_tokenizer(path: Path):
    """The model's tokenizer, loaded once per process: a job's plan, its engine length and its
    samples each want it, and a Qwen3.6 tokenizer (248k entries) takes ~1.5 s of a core to build.
    Kept by its directory and its files' times (a model rebuilt in place loads again); vx
    tokenizes on one thread and never changes a tokenizer it loaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path).resolve()
    key = (str(path), *(f.stat().st_mtime_ns for f in sorted(path.glob("tokenizer*"))))
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS.clear()  # one model per process in practice: no cache of every model a test built
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(path))
    return _TOKENIZERS[key]
