"""Shared fixtures: a tiny random hybrid-GDN model built once per test session, offline."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every engine a test starts needs well under 1 GiB of KV cache; vLLM's CPU default (0.3 of host
# memory, written through at start) would be ~7 GB per engine, and the suite runs engines side by side.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The suite runs on 2 workers (pytest -n 2, in pyproject.toml): an engine's start is mostly its
# three processes' imports, one core at a time, so one worker alone leaves a core idle ~40% of the
# time. Each worker gets its share of the cores (what it starts inherits it), so two tests never
# spin OpenMP teams on the same cores. A file's tests stay on one worker (module fixtures are built
# once); files that share a session fixture or a resource share a group.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores, _n = sorted(os.sched_getaffinity(0)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(_cores) >= _n > 1:
        _i = int(_WORKER[2:]) % _n
        _share = _cores[_i * len(_cores) // _n:(_i + 1) * len(_cores) // _n]
        os.sched_setaffinity(0, _share)
        os.environ["OMP_NUM_THREADS"] = str(len(_share))
GROUPS = {"test_cli": "chat-vllm-run", "test_first_run": "chat-vllm-run", "test_scale_out": "chat-vllm-run",
          "test_ray": "ray", "test_regen_partitions": "ray"}  # one local Ray cluster at a time
# the longest groups start first, by their times in a full run (2026-12-07), so that what is left
# for the end is short groups, which keep the two workers' finishing times close
FIRST = ["ray", "test_one_pass", "chat-vllm-run", "test_engine_lifetime", "test_fault_campaign", "test_vllm_backend",
         "test_follow", "test_regenerate", "test_selftest", "test_readme_promises", "test_s3", "test_hosts",
         "test_pinned_ring", "test_monitoring", "test_specforge", "test_dataset_fuzz", "test_vllm_changes",
         "test_modelopt", "test_two_writers", "test_loader", "test_speculators"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the groups into node ids: after it,
def pytest_collection_modifyitems(config, items):  # the marks were ignored and a file's tests spread
    def group(item) -> str:
        name = item.module.__name__
        return GROUPS.get(name, name)

    rank = {g: i for i, g in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(FIRST)))  # stable: file order kept within
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadgroup, but a worker gets its next group only once it is idle. xdist hands one
    over as soon as a worker has 2 tests left (one running, one it holds back to know the next
    item), so a group could be queued behind a 500 s test while the other worker ran dry at the
    end. Here a group goes to the first worker down to its held-back test: the longest-first
    order of FIRST then balances the two. (A worker cannot run its only test until it holds a
    second one, so a one-test group still takes the next group along: its file ends with a short
    test.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class WhenIdle(LoadGroupScheduling):
        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return WhenIdle(config, log)


def pytest_xdist_node_collection_finished(node, ids):
    """Under --dist loadgroup xdist sends a group to one worker by a suffix on each node id; a
    pytest/xdist pair that drops it (pytest-dev/pytest-xdist#1386) spreads every file over both
    workers, building each module fixture and engine twice: stop instead of running slowly."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit("pytest-xdist ignored the test groups (--dist loadgroup): install the pytest range that "
                    "pyproject.toml's test extra allows", returncode=3)


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


_BLOCK_LINE = re.compile(r"\((EngineCore[^)]*)\).*Using block size (\d+) for hidden-state cache layer")
_SEEN_LOGS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def engines_got_a_hidden_state_block_of_16_or_more(request, tmp_path_factory):
    """Every vLLM engine a test file started logged the block vLLM gave vx's hidden-state group
    (`Using block size N for hidden-state cache layer`): N >= 16 (vx/engine/plan.py), read after the
    file's tests from each engine log under the session's temporary directory."""
    yield
    small = []
    for log in Path(tmp_path_factory.getbasetemp()).rglob("*.log"):
        if "tensor_parallel" in str(log):  # TP 2 halves the tiny model's page: vLLM's cap there is 8
            continue
        try:
            stamp = log.stat().st_mtime_ns
            if _SEEN_LOGS.get(log) == stamp or log.stat().st_size > 64 << 20:
                continue
            _SEEN_LOGS[log] = stamp
            text = log.read_text(errors="replace")
        except OSError:
            continue
        small += [f"{log}: block {m.group(2)}" for m in _BLOCK_LINE.finditer(text) if int(m.group(2)) < 16]
    assert not small, "engines got a hidden-state block under 16 tokens:\n" + "\n".join(small[:10])
