"""Scale-out: data parallel engines, static partitions and Ray tasks write one output, exactly once.

Every test compares against a single-process run of the same data: same ids, same token counts,
states within the vLLM-vs-HF bound of test_vllm_backend (bf16 batching differs between runs)."""

import json
import os
import re

import pytest
import torch

import vx
from conftest import ROOT, machine_cache
from test_cli import vx_cmd
from test_s3 import CREDS, data_file, download, s3_server  # noqa: F401  (fixture)

CHAT = str(ROOT / "examples/chat.jsonl")
COS_MIN, REL_MAX = 0.9998, 0.04


def extract(*args, env=None):
    r = vx_cmd("extract", *args, "--json", env=env)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


@pytest.fixture(scope="module")
def single_vllm(chat_vllm_run, tiny_model):
    """One engine over examples/chat.jsonl (the run test_first_run checks)."""
    assert chat_vllm_run.result.returncode == 0, chat_vllm_run.result.stderr[-2000:]
    return vx.open_dataset(chat_vllm_run.out)


def assert_same_dataset(got, want, states=True):
    assert len(got.ids) == len(set(got.ids)), "duplicated samples"
    assert sorted(got.ids) == sorted(want.ids), "lost samples"
    for sid in want.ids:
        a, b = got[sid], want[sid]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        if states:
            ga, gb = a["hidden_states"].float(), b["hidden_states"].float()
            for j in range(ga.shape[1]):
                cos = torch.nn.functional.cosine_similarity(ga[:, j].flatten(), gb[:, j].flatten(), dim=0)
                assert cos >= COS_MIN, f"{sid} layer {j}: cosine {cos:.6f}"
                assert (ga[:, j] - gb[:, j]).abs().max() <= REL_MAX * gb[:, j].abs().max()


def test_two_tensor_parallel_engines_survive_a_killed_engine_and_give_the_single_process_dataset(tmp_path,
                                                                                                  single_vllm):
    """--dp 2 x --tensor-parallel-size 2 (on CPU: 4 ranks on this machine's cores; only TP rank 0
    captures), partition 1's engine core killed with SIGKILL as its 6th sample finishes: its
    worker ends (exit 3, the engine's pid and signal in its line), the run reports which
    partition and why, the same command finishes that partition only, and the output is the
    single process's dataset, balanced. (A killed partition worker is the same path to the
    launcher: a worker that exits non-zero; test_regen_partitions kills one.) One test for both
    dimensions: on CPU an engine's start is most of a run of these 64 samples."""
    out = tmp_path / "dp"
    # a 1,024-token step: the warm-up's dummy prefills go up to one step (16,384 tokens by default
    # on CPU, more than this run's data), and here 4 ranks of 2 engines share one core
    args = (CHAT, "-o", str(out), "--backend", "vllm", "--dp", "2", "--tensor-parallel-size", "2", "--max-num-seqs",
            "4", "--max-num-batched-tokens", "1024", "--shard-size", "0.5")
    r, _ = extract(*args, env={"VX_FAULT": "engine-sample:6", "VX_FAULT_PARTITION": "1"})
    assert r.returncode == 1 and "1 of 2 partitions failed: partition 1 (exit 3" in r.stderr, r.stderr[-2000:]
    assert re.search(r"the vLLM engine \(pid \d+\) died: killed by SIGKILL", r.stderr), r.stderr[-2000:]
    assert "rerun the same command" in r.stderr and "Traceback" not in r.stderr
    done_before = vx.open_dataset(out)
    assert 0 < len(done_before) < 64
    r, s = extract(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = s["partitions"]
    assert first["samples"] == 0, "partition 0 had finished; nothing of it is redone"
    assert second["samples"] > 0 and second["resumed_samples"] + second["samples"] == 64 - first["resumed_samples"]
    assert s["resumed_samples"] == len(done_before)
    assert sorted(d.name for d in out.glob("part-*")) == ["part-00000-of-00002", "part-00001-of-00002"]
    ds = vx.open_dataset(out)
    assert_same_dataset(ds, single_vllm)
    tokens = [sum(r["num_tokens"] for r in ds.shards if r["shard"].startswith(f"part-0000{i}")) for i in (0, 1)]
    assert max(tokens) - min(tokens) <= 0.05 * sum(tokens) / 2  # token-balanced partitions
    inspect = json.loads(vx_cmd("inspect", str(out), "--json").stdout)
    assert inspect["samples"] == 64 and inspect["tokens"] == 22544 and inspect["partitions"] == 2
    assert inspect["complete"] is True
    verify = vx_cmd("verify", str(out), "--samples", "2", "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout


def test_static_partitions_run_separately_and_resume_each_on_its_own(tmp_path, single_vllm):
    out = tmp_path / "parts"
    base = (CHAT, "-o", str(out), "--backend", "hf", "--num-partitions", "3")
    for i in (2, 0, 1):  # any order, any machine
        r, s = extract(*base, "--partition-index", str(i))
        assert r.returncode == 0 and s["samples"] > 0, r.stderr[-2000:]
    r, s = extract(*base, "--partition-index", "1")
    assert r.returncode == 0 and s["samples"] == 0 and s["resumed_samples"] > 0
    # the single process's ids, tokens and masks (the backends' are equal: test_cli)
    assert_same_dataset(vx.open_dataset(out), single_vllm, states=False)


def test_a_run_with_another_partition_count_skips_what_any_partition_committed(tmp_path, tiny_model):
    out = tmp_path / "out"
    r, first = extract(CHAT, "-o", str(out), "--backend", "hf", "--num-partitions", "4", "--partition-index", "2")
    assert r.returncode == 0
    r, rest = extract(CHAT, "-o", str(out), "--backend", "hf", "--dp", "2")  # the 8-GPU node died; 4 GPUs now
    assert r.returncode == 0, r.stderr[-2000:]
    assert rest["samples"] == 64 - first["samples"]
    r, again = extract(CHAT, "-o", str(out), "--backend", "hf")  # and a single process finds nothing left
    assert r.returncode == 0 and again["samples"] == 0 and again["resumed_samples"] == 0
    ds = vx.open_dataset(out)
    assert len(ds) == 64 and len(set(ds.ids)) == 64


@pytest.mark.parametrize("args, message", [
    (("--num-partitions", "2"), "--num-partitions needs --partition-index"),
    (("--num-partitions", "2", "--partition-index", "2"), "--partition-index must be in [0, 2)"),
    (("--num-partitions", "2", "--partition-index", "0", "--overwrite"), "would delete the other partitions"),
    (("--dp", "4", "--num-partitions", "2"), "would leave engines idle"),
    (("--gpus", "0,1,2", "--tensor-parallel-size", "2"), "not a multiple of --tensor-parallel-size"),
    (("--ray", "--dp", "2"), "give --num-partitions"),
])
def test_contradictory_scale_out_flags_are_refused_before_any_work(tmp_path, args, message):
    r = vx_cmd("extract", CHAT, "-o", str(tmp_path / "o"), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_data_parallel_to_s3_gives_one_verified_dataset(s3_server, tmp_path, tiny_model):  # noqa: F811
    url, client = s3_server
    env = dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))
    data = data_file(tmp_path)
    r, s = extract(str(data), "-o", "s3://vx-out/dp", "--endpoint-url", url, "--backend", "hf", "--dp", "2",
                   "--shard-size", "0.2", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert s["samples"] == 24 and s["errors"] == 1 and s["uploaded_bytes"] > 0
    # the rate from the uploads' own durations (it printed 0.0 MB/s), no faster than any partition's
    rates = [p["upload_mb_s"] for p in s["partitions"]]
    assert all(r > 0 for r in rates) and 0 < s["upload_mb_s"] <= max(rates) * 1.001
    names = download(client, "vx-out", "dp", tmp_path / "copy")
    assert "vx.json" in names and "part-00001-of-00002/manifest.jsonl" in names
    ds = vx.open_dataset(tmp_path / "copy")
    assert sorted(ds.ids) == sorted(f"s{i}" for i in range(24))
    verify = vx_cmd("verify", "s3://vx-out/dp", "--endpoint-url", url, "--samples", "2", "--json", env=env)
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout + verify.stderr[-1500:]


def test_engine_slots_are_gpu_groups_of_the_tensor_parallel_size_or_disjoint_cpu_cores(tmp_path):
    from vx.jobs.config import ExtractConfig
    from vx.launch.workers import worker_slots

    cfg = ExtractConfig(data=CHAT, output=tmp_path / "o", gpus=[4, 5, 6, 7], tensor_parallel_size=2)
    assert cfg.data_parallel_size == 2 and cfg.num_partitions == 2  # 4 GPUs = 2 engines x TP 2
    assert worker_slots(cfg) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    cpu = worker_slots(ExtractConfig(data=CHAT, output=tmp_path / "o", data_parallel_size=2))
    cores = [set(s["VX_CPU_CORES"].split(",")) for s in cpu]
    assert len(cpu) == 2 and (not cores[0] & cores[1] or len(os.sched_getaffinity(0)) < 2)
    assert all(s["VLLM_CPU_OMP_THREADS_BIND"] == s["VX_CPU_CORES"] for s in cpu)


def test_a_second_writer_on_the_same_output_stops_at_once(tmp_path, tiny_model):
    from vx.store.output import output_lock

    out = tmp_path / "out"
    with output_lock(out):  # another vx extract is writing here
        r = vx_cmd("extract", CHAT, "-o", str(out), "--backend", "hf")
    assert r.returncode == 2 and "is being written by another vx extract (pid" in r.stderr, r.stderr[-1000:]
    assert not list(out.glob("shard-*"))


def test_ray_tasks_carry_the_drivers_engine_settings_but_not_its_gpus():
    """A partition on another node runs the engine the driver's user configured: vLLM's, CUDA's,
    NCCL's, PyTorch's and OpenMP's variables travel with the task (with vx's, S3's and the hub's);
    CUDA_VISIBLE_DEVICES is Ray's to assign on each node, and unrelated variables stay home."""
    from vx.launch.ray_tasks import forwarded_env

    driver = {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900",
              "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_IB_DISABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "8", "VX_CACHE_DIR": "/c",
              "AWS_REGION": "us-east-1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root",
              "PATH": "/bin", "SLURM_JOB_ID": "7"}
    assert forwarded_env(driver) == {k: v for k, v in driver.items()
                                     if k not in ("CUDA_VISIBLE_DEVICES", "HOME", "PATH", "SLURM_JOB_ID")}
