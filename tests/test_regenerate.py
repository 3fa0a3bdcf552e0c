"""`vx regenerate` against vLLM's own LLM.chat: at temperature 0 every regenerated turn is what
LLM.chat answers for the same (regenerated) history; kill -9 and rerun gives every id once with
no torn line; `vx extract` of the output puts exactly the regenerated text under the loss mask."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, write_jsonl
from test_chat_templates import masked_runs
from test_cli import vx_cmd

CONVS = [
    {"id": "one", "messages": [{"role": "user", "content": "Explain hash maps."},
                               {"role": "assistant", "content": "A hash map stores keys."}]},
    {"id": "two", "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is the capital of France?"},
                               {"role": "assistant", "content": "Paris."},
                               {"role": "user", "content": "And of Germany?"},
                               {"role": "assistant", "content": "Berlin."}]},
    {"id": "open", "messages": [{"role": "user", "content": "Write a short poem about the sea."}]},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("regen")
    data = write_jsonl(d / "d.jsonl", CONVS)
    r = vx_cmd("regenerate", str(data), "-o", str(d / "r.jsonl"), "--max-tokens", str(MAX_TOKENS), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.strip() == ""  # the engine's log went to r.jsonl.vllm.log
    return d, json.loads(r.stdout), {rec["id"]: rec for rec in map(json.loads, open(d / "r.jsonl"))}


def test_greedy_turns_equal_vllm_llm_chat_on_the_regenerated_history(regenerated, tiny_model):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    _, summary, out = regenerated
    assert summary["conversations"] == 3 and summary["turns"] == 4  # "two" has 2 assistant turns
    assert sorted(out) == ["one", "open", "two"]
    assert [m["role"] for m in out["open"]["messages"]] == ["user", "assistant"]  # a reply was added
    two = out["two"]["messages"]
    assert [t["index"] for t in out["two"]["vx_turns"]] == [2, 4]
    assert two[2]["content"] != "Paris."  # the second turn sees the regenerated first one
    llm = LLM(model=str(tiny_model), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.1, seed=0)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for sid, rec in out.items():
            for turn in rec["vx_turns"]:
                k = turn["index"]
                history = rec["messages"][:k]
                [ref] = llm.chat(history, greedy, use_tqdm=False)
                assert rec["messages"][k]["content"] == ref.outputs[0].text, (sid, k)
                assert turn["completion_tokens"] == len(ref.outputs[0].token_ids)
                assert turn["finish_reason"] == ref.outputs[0].finish_reason
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_extract_of_the_output_masks_exactly_the_regenerated_text(regenerated, tokenizer):
    import vx

    d, _, out = regenerated
    r = vx_cmd("extract", str(d / "r.jsonl"), "-o", str(d / "ex"), "--backend", "hf", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    ds = vx.open_dataset(d / "ex")
    for sid, rec in out.items():
        item = ds[sid]
        runs = masked_runs(tokenizer, item["input_ids"].tolist(), item["loss_mask"].tolist())
        assert runs == [m["content"] + "<|im_end|>" for m in rec["messages"] if m["role"] == "assistant"], sid


def test_kill_9_then_rerun_gives_every_id_once_and_no_torn_line(tmp_path, tiny_model):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question number {i}"}]} for i in range(24)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [sys.executable, "-m", "vx", "regenerate", str(data), "-o", str(tmp_path / "r.jsonl"),
            "--max-tokens", "6", "--commit-every", "4", "--max-num-seqs", "4"]
    killed = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env=dict(os.environ, VX_FAULT="after-chunk:2"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    first = [json.loads(x)["id"] for x in open(tmp_path / "r.jsonl")]
    assert 0 < len(first) < 24  # killed after its second fsynced chunk
    with open(tmp_path / "r.jsonl", "ab") as f:  # a crash mid-append leaves a torn line
        f.write(b'{"id": "c99", "messa')
    again = subprocess.run(args + ["--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    s = json.loads(again.stdout)
    assert s["skipped"] == len(first) and s["conversations"] == 24 - len(first)
    lines = open(tmp_path / "r.jsonl").read().splitlines()
    ids = [json.loads(x)["id"] for x in lines]  # every line parses: the torn one is gone
    assert sorted(ids) == sorted(r["id"] for r in rows)
