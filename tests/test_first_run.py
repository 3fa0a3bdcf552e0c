"""The first command on a fresh clone, as a user sees it: results on stdout, a quiet stderr
(vLLM's log goes to OUT/logs/vllm.log), no leaked-resource warnings, an engine that shuts down
without being force-killed. (-v, vLLM's log live: test_readme_promises' vLLM dtype runs.)"""

import json
import re

import vx
from test_engine_budget import fewest_that_fill

# not a terminal: a progress line every 30 s once samples flow (vx/monitor/progress.py), none in a
# shorter run; a loaded machine's run can be longer
PROGRESS_LINE = re.compile(r"extract: \d+/64  [\d.]+ samples/s  \d[\d,]* tok/s  MFU [\d.]+%  .*ETA [\d:]+$")


def test_the_first_vllm_run_prints_only_its_results_and_keeps_the_log_in_the_output(chat_vllm_run):
    """`vx extract examples/chat.jsonl -o OUT --backend vllm --json --verify 8` from a fresh cache."""
    r, out = chat_vllm_run.result, chat_vllm_run.out
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples"] == 64
    noise = [line for line in r.stderr.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert noise == [], r.stderr  # no tty: no bar, no engine log, no warning; at most the periodic line
    # the engine's max_model_len is the longest sample + 1, not the model's 8,192, rounded up to a
    # whole hidden-state block: the block vLLM gave vx's group (read back from the engine) >= 16
    ds = vx.open_dataset(out)
    longest, block = max(len(ds[i]["input_ids"]) for i in range(len(ds))) + 1, summary["hidden_block"]
    assert block >= 16 and summary["max_model_len"] % block == 0
    assert longest <= summary["max_model_len"] < longest + block < 8192
    assert f"hidden states {block} tokens" in summary["engine_plan"]
    # the step budget (vx/engine/budget.py): the CPU step, and max_num_seqs the fewest consecutive
    # samples of this dataset that fill it in every stretch, + 1 (CPU scheduling is synchronous),
    # as vLLM logged the engine's arguments
    lengths = [len(r["input_ids"]) for r in sorted((ds[i] for i in range(len(ds))), key=lambda r: r["id"])]
    seqs = fewest_that_fill(lengths, 16384)
    assert f"step 16,384 tokens, max_num_seqs {seqs} (" in summary["engine_plan"]
    assert f"'max_num_batched_tokens': 16384, 'max_num_seqs': {seqs}," in (out / "logs" / "vllm.log").read_text()
    # --verify 8: eight samples recomputed with the fp32 HF reference, every layer within the bound
    v = summary["verify"]
    assert v["ok"] and v["samples_checked"] == 8 and v["reference"].startswith("float32")
    assert [w["layer"] for w in v["layers"]] == [1, 2, 3, 4, 5] and min(w["min_cosine"] for w in v["layers"]) >= 0.9995
    # its progress record (what vx inspect --watch reads): the final figures, the state done
    rec = json.loads((out / "progress.json").read_text())
    assert rec["state"] == "done" and rec["samples"] == 64 and rec["tokens"] == summary["tokens"]
    assert 0 < rec["mfu"] < 1 and rec["device_memory_bytes"] > 0 and rec["in_flight"] == 0
    assert 0 < summary["mfu"] < 1 and "CPU cores" in summary["peak"]
    log = (out / "logs" / "vllm.log").read_text()
    assert "EngineCore" in log and "INFO" in log  # the full log, engine processes included
    assert "[shutdown] MPClient: complete" in log and "force killing" not in log
