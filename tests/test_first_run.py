"""The first command on a fresh clone, as a user sees it: results on stdout, a quiet stderr
(vLLM's log goes to OUT/logs/vllm.log), no leaked-resource warnings, an engine that shuts down
without being force-killed; -v shows vLLM's log live."""

import json

import vx
from test_cli import vx_cmd



def test_the_first_vllm_run_prints_only_its_results_and_keeps_the_log_in_the_output(chat_vllm_run):
    """`vx extract examples/chat.jsonl -o OUT --backend vllm --json --verify 8` from a fresh cache."""
    r, out = chat_vllm_run.result, chat_vllm_run.out
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples"] == 64
    assert r.stderr.strip() == "", r.stderr  # no tty: no progress bar either
    # the engine's max_model_len is the longest sample + 1, not the model's 8,192
    ds = vx.open_dataset(out)
    assert summary["max_model_len"] == max(len(ds[i]["input_ids"]) for i in range(len(ds))) + 1 < 8192
    # --verify 8: eight samples recomputed with the fp32 HF reference, every layer within the bound
    v = summary["verify"]
    assert v["ok"] and v["samples_checked"] == 8 and v["reference"].startswith("float32")
    assert [w["layer"] for w in v["layers"]] == [1, 2, 3, 4, 5] and min(w["min_cosine"] for w in v["layers"]) >= 0.9995
    log = (out / "logs" / "vllm.log").read_text()
    assert "EngineCore" in log and "INFO" in log  # the full log, engine processes included
    assert "[shutdown] MPClient: complete" in log and "force killing" not in log


def test_verbose_shows_the_vllm_log_live(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 9}) + "\n" for i in range(4)))
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "vllm", "-v")
    assert r.returncode == 0, r.stderr
    assert "INFO" in r.stderr and "EngineCore" in r.stderr
    assert not (tmp_path / "out" / "logs" / "vllm.log").exists()
    bad = [line for line in r.stderr.splitlines() if any(n in line for n in ("resource_tracker", "Traceback",
                                                                             "force killing"))]
    assert not bad, bad
