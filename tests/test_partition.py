"""The partition plan: deterministic across runs, processes and machines, balanced by tokens."""

import subprocess
import sys

import numpy as np

from conftest import ROOT, write_jsonl
from vx.launch.plan import assign, balance, line_weights, make_plan



def chat_like(path, n=3000, seed=0):
    """n conversations with a long-tailed length distribution like real chat data (lognormal words)."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(500)]
    rows = []
    for i in range(n):
        q, a = (max(1, int(x)) for x in rng.lognormal(4.0, 1.0, size=2))
        rows.append({"id": f"c{i}", "messages": [{"role": "user", "content": " ".join(rng.choice(words, q))},
                                                 {"role": "assistant", "content": " ".join(rng.choice(words, a))}]})
    return write_jsonl(path, rows)


def test_greedy_assignment_keeps_partitions_within_one_sample_of_each_other():
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 3000, size=5000).tolist()
    for count in (2, 3, 8):
        parts = np.asarray(assign(weights, count))
        loads = [sum(w for w, p in zip(weights, parts) if p == k) for k in range(count)]
        assert max(loads) - min(loads) <= max(weights)


def test_every_line_has_one_partition_blank_lines_none_and_bad_lines_still_one(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}, "", "{not json", {"text": "hello " * 30}])
    plan = make_plan(data, tiny_model, 2, procs=1)
    assert plan.tolist()[1] == -1 and all(p in (0, 1) for i, p in enumerate(plan.tolist()) if i != 1)


def test_plan_on_chat_like_data_is_token_balanced_within_5_percent_and_the_same_in_every_process(
        tiny_model, tmp_path):
    data = chat_like(tmp_path / "chat.jsonl")
    weights = line_weights(data, tiny_model, procs=2)
    assert (weights > 0).sum() == 3000
    plans = {}
    for count in (2, 3, 4, 8):
        plan = plans[count] = np.full(len(weights), -1, dtype=np.int32)
        plan[weights >= 0] = assign(weights[weights >= 0].tolist(), count)
        spread = balance(plan, weights, count)["spread"]
        print(f"{count} partitions: token spread {spread:.4%}")
        assert spread <= 0.05, f"{count} partitions: token spread {spread:.2%}"
    code = ("import sys, numpy as np; from vx.launch.plan import make_plan; "
            "np.save(sys.argv[1], make_plan(sys.argv[2], sys.argv[3], 4, procs=1))")
    out = ROOT / ".plan-test.npy"  # another process, another hash seed, the work not split
    try:
        subprocess.run([sys.executable, "-c", code, str(out), str(data), str(tiny_model)], check=True,
                       env={"PYTHONHASHSEED": "7", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, cwd=ROOT)
        assert np.array_equal(np.load(out), plans[4])
    finally:
        out.unlink(missing_ok=True)
