"""`vx selftest` and `vx extract --verify`: they pass on a correct install and fail, naming the
sample and layer, when the capture path silently corrupts states (the VX_FAULT=corrupt-layer:j
failpoint shifts layer position j of every captured chunk by one token: an off-by-one the
checks before commit cannot see, since the values stay finite and non-zero)."""

import json
import re

from test_cli import ROOT, vx_cmd


def test_selftest_on_the_embedded_default_passes_and_times_bare_vllm(tmp_path):
    """Run as a user runs it: from the wheel installed in a fresh venv (tests/user_install.py), outside
    the checkout; vx's changes to vLLM active in its engine, read back from it, and one page billed
    per hidden-state block."""
    import subprocess

    from s3_faults import free_port
    from test_s3 import CREDS, start_s3
    from user_install import user_install

    python, env, home = user_install(tmp_path)
    server, url, s3 = start_s3(free_port())  # --upload: the S3 path, proven against a real endpoint
    try:
        r = subprocess.run([str(python), "-m", "vx", "selftest", "--upload", "s3://vx-out/scratch", "--endpoint-url",
                            url], capture_output=True, text=True, cwd=home, timeout=900,
                           env=dict(env, **CREDS, VX_CACHE_DIR=str(tmp_path / "cache")))
        assert not s3.list_objects_v2(Bucket="vx-out", Prefix="scratch/").get("KeyCount")  # all deleted after
    finally:
        server.stop()
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert rows["result"].endswith("PASS")
    up = re.search(r"(\d+) shards \(.*through awscrt at .*a 12 MiB multipart probe \(3 parts, S3's CRC64-NVME "
                   r"\S+ as sent\); (\d+) of (\d+) samples read back by byte range equal", rows["upload"])
    assert up and int(up[1]) >= 1 and up[2] == up[3] and int(up[3]) >= 40, rows["upload"]
    assert "bare vLLM prefill" in rows["throughput"] and "vx/bare" in rows["throughput"]
    assert "2 over the 512-token step (chunked)" in rows["data"]
    assert "float32" in rows["reference"]
    # the one-pass mode: every conversation regenerated, captured, rows = the template's rendering
    assert "8 conversations, 10 turns" in rows["one"] and "rendering for 8/8" in rows["one"], rows["one"]
    # the same samples again, fp8, through a ring cut to the copies in flight and a writer that
    # started only once the forward waited for space: every sample within fp8's bound, no spills,
    assert re.search(r"capture threads' CPU [\d.]+s intake \+ [\d.]+s writer over [\d.]+s", rows["engine"]), rows["engine"]
    # the step budget: the selftest's 512-token step kept, max_num_seqs chosen from its samples' lengths
    assert int(re.search(r"step 512 tokens, max_num_seqs (\d+),", rows["engine"])[1]) >= 2, rows["engine"]
    # states coded in row blocks (--compress blocks) there, and read back through them
    bp = re.search(r"(\d+) waits, (\d+) spills; states coded in blocks \(--compress blocks\) ([\d.]+)x smaller; "
                   r"worst cosine ([\d.]+)", rows["backpressure"])
    assert bp and int(bp[1]) >= 1 and int(bp[2]) == 0 and float(bp[3]) > 1.0 and float(bp[4]) >= 0.99, \
        rows["backpressure"]
    changes = re.search(r"vx's changes to vLLM active in the engine \(read back from rank 0\): ([\w, ]+)", rows["engine"])
    assert changes and set(changes[1].split(", ")) == {"hidden_state_billing", "cpu_bf16_gemm_fp32",
                                                         "cpu_gdn_one_decode_indices", "cpu_gdn_spec_native_conv",
                                                         "cpu_seeded_chunked_prefill"}, rows["engine"]
    assert "memory plan: " in rows["engine"] and "widest group" not in rows["engine"], rows["engine"]
    layer_rows = [line.split() for line in r.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(x[0]) for x in layer_rows] == list(range(8))  # every layer of the model, the last included
    assert all(float(x[1]) >= 0.9995 for x in layer_rows)


def test_selftest_of_a_vl_layout_checkpoint_fails_naming_sample_and_layer_when_a_layer_is_corrupted(
        tmp_path, tiny_vl_model):
    """--model: a 4-layer random twin of a VL-layout checkpoint (built, loaded text-only, compared
    with the fp32 reference). Under the failpoint, layer 2 fails for every sample and the run
    exits 1 naming one; the other layers stay within the bound."""
    report = tmp_path / "selftest.json"
    r = vx_cmd("selftest", "--model", str(tiny_vl_model), "--no-bench", "--no-one-pass", "--samples", "16", "--report", str(report),
               env={"VX_FAULT": "corrupt-layer:2"})
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "FAIL" in r.stdout
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("vx: error: selftest failed: sample '") and " layer 2: cosine " in err, err
    got = json.loads(report.read_text())
    assert got["samples"] == 16 and "VL layout" in got["rows"]["model"] and "4 layers" in got["rows"]["model"]
    # the real target's capture engine, planned from its config: the block vLLM gives its hidden states
    plan = got["rows"]["target plan"]
    assert "samples up to 4,096 tokens" in plan and int(plan.split("hidden states ")[1].split()[0]) >= 16, plan
    # and its step budget, its dataset unknown: a CPU step of 64-token samples (16,384 / 64 + 1)
    assert "step 16,384 tokens, max_num_seqs 257 (" in plan, plan
    engine = got["rows"]["engine"]  # the twin's block, read back from its engine
    assert int(engine.split("hidden-state block ")[1].split()[0]) >= 16, engine
    worst = {w["layer"]: w["min_cosine"] for w in got["layers"]}
    assert sorted(worst) == [0, 1, 2, 3] and worst[2] < 0.9
    assert all(worst[k] >= 0.9995 for k in (0, 1, 3))
    assert got["failures"] and all(" layer 2: " in f for f in got["failures"])


def test_extract_verify_fails_under_the_same_failpoint(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(open(ROOT / "examples" / "chat.jsonl").readlines()[:16]))
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--verify", "8", "--max-num-batched-tokens", "512",
               env={"VX_FAULT": "corrupt-layer:2"})  # a small step: the warm-up prefills up to one step
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "verify       MISMATCH" in r.stdout
    err = r.stderr.strip().splitlines()[-1]
    # layer position 2 of ids 1,2,3,4,5 is layer 3; the other layers pass
    assert err.startswith("vx: error: --verify 8: sample '") and " layer 3: cosine " in err, err
    layers = {int(line.split()[1]): float(line.split()[4]) for line in r.stdout.splitlines()
              if line.startswith("layer ")}
    assert layers[3] < 0.9 and all(v >= 0.9995 for k, v in layers.items() if k != 3)
