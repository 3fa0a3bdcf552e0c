"""What the README and docs/ promise, each through the real `vx` command: store dtypes and both codings (zstd files, coded row blocks) on both
backends (the vLLM worker's own writer included), refusal of another model, hidden size or store
dtype on the same output, --strict, and kill -9 of a vLLM run that writes to S3, after which
`vx verify` recomputes every sample, the redone ones included (the vLLM worker's writer staging at
most --max-local-gb while the driver uploads). References are plain HF forwards
(output_hidden_states), not vx's extractors."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import vx
from conftest import ROOT, machine_cache, write_jsonl
from test_cli import vx_cmd
from test_s3 import CREDS, download, s3_server  # noqa: F401  (fixture)

LAYERS = [1, 4, 6]
ROWS = [{"id": f"s{i}", "text": f"row {i} says " + "hello world " * (3 + 5 * i)} for i in range(6)]


def hf_states(model_dir, ids: list[int]) -> torch.Tensor:
    """[T, L, H] fp32 states of LAYERS from a plain HF forward: layer k = hidden_states[k + 1]."""
    from transformers import AutoModelForCausalLM

    model = hf_states.cache.get(str(model_dir))
    if model is None:
        model = hf_states.cache[str(model_dir)] = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.stack([hs[k + 1][0] for k in LAYERS], dim=1)


hf_states.cache = {}


def worst_cosine(ds, model_dir) -> float:
    worst = 1.0
    for sid in ds.ids:
        item = ds[sid]
        got, ref = item["hidden_states"].float(), hf_states(model_dir, item["input_ids"].tolist())
        assert got.shape == ref.shape
        for j in range(len(LAYERS)):
            worst = min(worst, torch.nn.functional.cosine_similarity(got[:, j].flatten(), ref[:, j].flatten(),
                                                                     dim=0).item())
    return worst


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_store_dtypes_and_both_codings_round_trip_through_the_cli(backend, tmp_path, tiny_model):
    from safetensors import safe_open

    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    stored = {"fp16": "torch.float16", "fp32": "torch.float32", "fp8": "torch.float8_e4m3fn"}
    cases = [("fp16", None, 0.9998), ("fp32", None, 0.9998), ("fp8", "zstd", 0.99), ("bf16", "blocks", 0.9998)]
    if backend == "vllm":  # the worker's writer casts and codes as the driver's does: one engine, fp8 in blocks
        cases = [("fp8", "blocks", 0.99)]
    # independent runs, started at once (an engine's start is mostly its processes' imports),
    # each vLLM engine with a small share of host memory
    runs = [subprocess.Popen(
        [sys.executable, "-m", "vx", "extract", str(data), "-o", str(tmp_path / f"{backend}-{dtype}"), "--backend",
         backend, "--layers", ",".join(map(str, LAYERS)), "--store-dtype", dtype, "--json",
         *(["--compress", compress] if compress else []), "--gpu-memory-utilization", "0.05",
         *(["-v"] if verbose(backend, dtype) else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for dtype, compress, _ in cases]
    results = [(run.communicate(timeout=900), run.returncode) for run in runs]
    for (dtype, compress, floor), ((stdout, stderr), rc) in zip(cases, results):
        out = tmp_path / f"{backend}-{dtype}"
        assert rc == 0, stderr[-3000:]
        assert json.loads(stdout)["samples"] == len(ROWS)
        shards = sorted(out.glob("shard-*"))
        assert shards and all(f.name.endswith(".zst") == (compress == "zstd") for f in shards)
        if not compress:  # the bytes on disk are in the store dtype
            with safe_open(str(shards[0]), "pt") as f:
                assert str(f.get_tensor("hidden_states").dtype) == stored[dtype]
        if compress == "blocks":  # coded rows: a safetensors file of fewer bytes than the states
            with safe_open(str(shards[0]), "pt") as f:
                coded = f.get_tensor("hidden_states.blocks")
            ds = vx.open_dataset(out)
            assert coded.dtype == torch.uint8 and coded.numel() < ds.num_tokens * len(LAYERS) * ds.meta["hidden_size"] \
                * (1 if dtype == "fp8" else 2)
        ds = vx.open_dataset(out)
        assert ds.meta["store_dtype"] == dtype and ds.layer_ids == LAYERS
        cos = worst_cosine(ds, tiny_model)
        assert cos >= floor, (backend, dtype, cos)
        if verbose(backend, dtype):  # -v: vLLM's log live on stderr instead of OUT/logs/vllm.log
            assert "INFO" in stderr and "EngineCore" in stderr
            assert not (out / "logs" / "vllm.log").exists()
            bad = [line for line in stderr.splitlines()
                   if any(n in line for n in ("resource_tracker", "Traceback", "force killing"))]
            assert not bad, bad


def verbose(backend: str, dtype: str) -> bool:
    """The vLLM run also shows that -v prints vLLM's log live (no engine of its own)."""
    return backend == "vllm"


def test_another_model_hidden_size_or_store_dtype_on_the_same_output_is_refused(tmp_path, tiny_model):
    from vx.data.tiny import build_tiny_model

    data = write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    out = str(tmp_path / "out")
    assert vx_cmd("extract", str(data), "-o", out, "--backend", "hf").returncode == 0
    retrained = tmp_path / "retrained"  # same architecture and size, another config: another model
    shutil.copytree(tiny_model, retrained)
    cfg = json.loads((retrained / "config.json").read_text())
    (retrained / "config.json").write_text(json.dumps(dict(cfg, rope_theta_note="another checkpoint")))
    wider = build_tiny_model(tmp_path / "wider", hidden_size=128)
    for extra, key in [(["--store-dtype", "fp16"], "store_dtype"), (["--model", str(retrained)], "model_fingerprint"),
                       (["--model", str(wider)], "hidden_size")]:
        r = vx_cmd("extract", str(data), "-o", out, "--backend", "hf", *extra)
        assert r.returncode == 2 and key in r.stderr and "--overwrite" in r.stderr, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert len(vx.open_dataset(out)) == 2 and vx.open_dataset(out).meta["store_dtype"] == "bf16"


def test_strict_stops_at_the_first_bad_record_before_any_compute(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], "{oops", ROWS[1]])
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf", "--strict")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "d.jsonl:2" in line and "invalid JSON" in line and "--strict" in line
    assert not list((tmp_path / "out").glob("shard-*"))


def test_kill_9_of_a_vllm_run_to_s3_then_rerun_gives_every_sample_once_and_verify_recomputes_them(
        s3_server, tmp_path, tiny_model):  # noqa: F811
    url, client = s3_server
    rows = [{"id": f"k{i}", "text": f"sample {i} " * (20 + 40 * (i % 5))} for i in range(24)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    env = dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))
    # the worker's writer stages at most --max-local-gb (plus the shard it writes) while the driver uploads
    args = ["extract", str(data), "-o", "s3://vx-out/vllm-kill", "--endpoint-url", url, "--backend", "vllm",
            "--max-num-batched-tokens", "512", "--max-num-seqs", "4", "--shard-size", "2", "--max-local-gb", "0.001",
            "--json"]
    killed = vx_cmd(*args, env=dict(env, VX_FAULT="after-step:6"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    again = vx_cmd(*args, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    s = json.loads(again.stdout)
    assert 0 < s["samples"] < 24 and s["resumed_samples"] + s["samples"] == 24  # the rerun redid only the rest
    copy = tmp_path / "copy"
    download(client, "vx-out", "vllm-kill", copy)
    ids = [sid for line in open(copy / "manifest.jsonl") for sid in json.loads(line)["sample_ids"]]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    largest_shard = max(json.loads(line)["bytes"] for line in open(copy / "manifest.jsonl"))
    assert 0 < s["bytes_written"] <= s["uploaded_bytes"] and s["peak_local_bytes"] <= 0.001e9 + largest_shard
    v = vx_cmd("verify", "s3://vx-out/vllm-kill", "--endpoint-url", url, "--samples", "24", "--json", env=CREDS)
    assert v.returncode == 0, v.stdout + v.stderr[-2000:]
    report = json.loads(v.stdout)
    assert report["ok"] and report["samples_checked"] == 24
