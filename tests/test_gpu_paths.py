"""The device-independent logic of vx's GPU paths, checked on CPU (CI has no GPU).

- No vx entry point makes a later fork unusable for CUDA: each runs in a subprocess whose torch
  answers like a machine with 8 GPUs (tests/fake_cuda.py) and records every call that would
  initialise CUDA; vllm.LLM is replaced where vx imports it by a probe that reports the start
  method vLLM would use for its engine and the engine arguments, then stops the run.
- `--gpus` ids index the GPUs this process sees (an inherited CUDA_VISIBLE_DEVICES).
- A freed engine slot is reused only once every process of its previous worker's group is gone.
- The engine's max_model_len comes from the data, not the model's 262,144.
- vLLM #51016 (tensor parallel pages smaller than a token's captured states), computed for a
  27B-class hybrid target and a dense one.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAT = str(ROOT / "examples" / "chat.jsonl")
FAKE = str(ROOT / "tests" / "fake_cuda.py")


def fake_gpu_run(*args, env=None, tmp_path=None):
    e = dict(os.environ, **(env or {}))
    e.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # as in a fresh shell
    r = subprocess.run([sys.executable, FAKE, *args], capture_output=True, text=True, env=e, cwd=tmp_path or ROOT,
                       timeout=600)
    return r


def probe_of(r) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, f"the run never reached its engine's start:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("PROBE "):])


def assert_fork_safe(probe: dict) -> None:
    assert probe["poisoned"] == [], "\n".join(probe["poisoned"])
    assert probe["nvml_check"] == "1"
    assert probe["start_method"] == "spawn"


def test_extract_is_fork_safe_and_sizes_max_model_len_from_the_data(tmp_path, tiny_model, tokenizer):
    from vx.data.samples import Reading, Tokenize, read_samples
    from vx.data.model import model_info
    from vx.data.inputs import Input

    r = fake_gpu_run("cli", "extract", CHAT, "-o", str(tmp_path / "out"), "--backend", "vllm", tmp_path=tmp_path)
    probe = probe_of(r)
    assert_fork_safe(probe)
    tokenize = Tokenize(tokenizer, Reading(), model_info(tiny_model).vocab_size)
    longest = max(len(s) for s in read_samples(Input(CHAT), tokenize))
    # not the model's 8,192: the longest sample + 1, rounded up to a whole hidden-state block by the plan
    assert longest + 1 <= probe["engine_kwargs"]["max_model_len"] < longest + 1 + 64
    assert probe["engine_kwargs"]["gpu_memory_utilization"] == 0.9  # the GPU path was taken


def test_regenerate_is_fork_safe(tmp_path, tiny_model):
    """The defect vLLM 0.33 would have met: regenerate asked torch.cuda.is_available() before any
    vLLM import, and vLLM then forked its engine."""
    assert_fork_safe(probe_of(fake_gpu_run("cli", "regenerate", CHAT, "-o", str(tmp_path / "r.jsonl"),
                                           tmp_path=tmp_path)))


def test_a_launchers_partition_worker_is_fork_safe(tmp_path, tiny_model):
    from types import SimpleNamespace

    from vx.jobs.config import ExtractConfig
    from vx.jobs.extract import worker_config

    cfg = ExtractConfig(data=CHAT, output=tmp_path / "out", backend="vllm", data_parallel_size=2)
    config = worker_config(SimpleNamespace(cfg=cfg), 1, None, None)
    probe = probe_of(fake_gpu_run("worker", json.dumps(config), tmp_path=tmp_path))
    assert_fork_safe(probe)


def test_selftest_is_fork_safe(tmp_path, tiny_model):
    assert_fork_safe(probe_of(fake_gpu_run("cli", "selftest", "--no-bench", tmp_path=tmp_path)))


def slots(config: dict, visible: str | None):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    r = fake_gpu_run("slots", json.dumps(dict(config, data=CHAT, output="/tmp/vx-slots-unused")), env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith(("SLOTS ", "USAGE "))]
    assert line, r.stderr[-2000:]
    kind, _, body = line[-1].partition(" ")
    return json.loads(body) if kind == "SLOTS" else body


def test_gpu_ids_index_the_gpus_this_process_sees():
    """Under SLURM or Kubernetes with CUDA_VISIBLE_DEVICES=4,5,6,7, --gpus 0,1 is GPUs 4 and 5."""
    got = slots({"gpus": [0, 1]}, "4,5,6,7")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in got["slots"]] == ["4", "5"] and got["poisoned"] == []
    got = slots({"gpus": [2, 3], "tensor_parallel_size": 2}, "4,5,6,7")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in got["slots"]] == ["6,7"]
    got = slots({"gpus": [1]}, "GPU-aaaa,GPU-bbbb")  # UUIDs pass through as named
    assert [s["CUDA_VISIBLE_DEVICES"] for s in got["slots"]] == ["GPU-bbbb"]
    assert "ids must be in 0..3" in slots({"gpus": [0, 4]}, "4,5,6,7")
    got = slots({"data_parallel_size": 2}, None)  # nothing inherited: every GPU of the machine
    assert [s["CUDA_VISIBLE_DEVICES"] for s in got["slots"]] == ["0", "1"]


WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    # a worker whose engine process outlives it: in its group, ignores SIGTERM for a while, and
    # does not hold the worker's stdout (so the launcher's reader sees the end at once)
    if os.fork() == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(float(sys.argv[2]))
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        os._exit(0)
    print(json.dumps({"vx": "summary", "summary": {}, "samples": 1, "tokens": 1, "skipped": 0}), flush=True)
""")


def test_a_freed_slot_is_reused_only_after_its_workers_group_is_gone(tmp_path):
    from vx.launch.workers import Tally, read_events, run_workers
    from vx.monitor.progress import RunProgress

    started = {}

    def start(index, slot_env, events):
        import threading

        started[index] = time.time()
        proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / f"engine-{index}.gone"), "1.5"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        reader = threading.Thread(target=read_events, args=(proc.stdout, lambda rec: events.put((index, rec))),
                                  daemon=True)
        reader.start()
        return proc, index, time.perf_counter(), tmp_path / "log", reader

    results, failed = run_workers(2, [{}], start, Tally(RunProgress(None, enabled=False)))
    assert not failed and sorted(results) == [0, 1]
    gone = tmp_path / "engine-0.gone"
    for _ in range(100):  # (a launcher that did not wait returns before it exists)
        if gone.exists() and gone.read_text():
            break
        time.sleep(0.05)
    engine_gone = float(gone.read_text())
    assert started[1] >= engine_gone  # the second worker started after the first one's engine exited


def test_tensor_parallel_pages_for_27b_class_targets():
    """vLLM #51016: a 27B-class hybrid target is not exposed at TP 2/4/8 (its pages follow the GDN
    state, ~0.4-1.6 MB per rank, against 51,200 B of states per token); a dense target with 8 KV
    heads is from TP 2 on, and the vLLM vx runs scales its pages (PR #50894, in 0.32 and 0.33);
    without that fix the run stops before any weight loads."""
    from vx.engine.defaults import page_check, vllm_scales_pages

    hybrid = {"hidden_size": 5120, "num_key_value_heads": 4, "head_dim": 256, "num_attention_heads": 24,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_value_heads": 48,
              "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4}
    for tp in (2, 4, 8):
        c = page_check({"text_config": hybrid}, tp, 5)
        assert c["state_bytes_per_token"] == 51_200 and not c["exposed"] and c["page_bytes"] > 8 * 51_200 / tp
    dense = {"hidden_size": 5120, "num_key_value_heads": 8, "head_dim": 128, "num_attention_heads": 64}
    assert not page_check(dense, 1, 5)["exposed"]
    assert all(page_check(dense, tp, 5)["exposed"] for tp in (2, 4, 8))
    assert vllm_scales_pages()  # the installed vLLM has the fix


def test_without_vllms_page_fix_an_exposed_run_stops_with_one_line(tmp_path, monkeypatch):
    import vx.engine.defaults as ed
    from vx.errors import UsageError

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 5120, "num_key_value_heads": 8,
                                                      "head_dim": 128, "num_attention_heads": 64}))
    monkeypatch.setattr(ed, "vllm_scales_pages", lambda: False)
    with pytest.raises(UsageError, match="#51016"):
        ed.check_tensor_parallel_pages(tmp_path, 4, 5)
    assert ed.check_tensor_parallel_pages(tmp_path, 1, 5) is None
