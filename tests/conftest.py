"""Shared fixtures: a tiny random hybrid-GDN model built once per test session, offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A clean vx cache for the whole session (nothing reused from earlier runs)."""
    d = tmp_path_factory.mktemp("vx-cache")
    os.environ["VX_CACHE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_model(cache_dir) -> Path:
    from vx.data.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_vl_model(tiny_model, cache_dir) -> Path:
    from vx.data.tiny import build_vl_twin

    return build_vl_twin(tiny_model, cache_dir / "tiny-vl")


@pytest.fixture(scope="session")
def fp32_model(tiny_model):
    from vx.engine.hf_extractor import load_hf_model

    return load_hf_model(tiny_model, "float32", "cpu")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from vx.data.model import load_tokenizer

    return load_tokenizer(tiny_model)


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped as JSON) or bytes/str (written verbatim as one line)."""
    with open(path, "wb") as f:
        for r in rows:
            if isinstance(r, bytes):
                f.write(r.rstrip(b"\n") + b"\n")
            elif isinstance(r, str):
                f.write(r.encode() + b"\n")
            else:
                f.write(json.dumps(r).encode() + b"\n")
    return path


@pytest.fixture(scope="session")
def chat_vllm_run(tmp_path_factory):
    """The README's first command with the vLLM backend, `vx extract examples/chat.jsonl -o OUT
    --backend vllm --json --verify 8`, from a fresh vx cache (as on a fresh clone): run once, and
    shared by the tests that only read its result (stdout, stderr, logs, the output)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    base = tmp_path_factory.mktemp("chat-vllm")
    out = base / "out"
    r = subprocess.run([sys.executable, "-m", "vx", "extract", "examples/chat.jsonl", "-o", str(out), "--backend",
                        "vllm", "--json", "--verify", "8"], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env=dict(os.environ, VX_CACHE_DIR=str(base / "cache")))
    return SimpleNamespace(result=r, out=out)


def machine_cache(path: Path) -> str:
    """A fresh vx cache directory, as on a new machine (no staging, no plans, no logs), holding the
    session's embedded model: building it again costs ~6 s per use, and that build is tested on
    its own (test_cli's clean-cache tests)."""
    from vx.data.tiny import default_model_dir

    model = default_model_dir()
    path.mkdir(parents=True, exist_ok=True)
    if not (path / model.name).exists():
        (path / model.name).symlink_to(model, target_is_directory=True)
    return str(path)
