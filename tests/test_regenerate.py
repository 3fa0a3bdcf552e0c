"""`vx regenerate` against vLLM's own LLM.chat: at temperature 0 every regenerated turn is what
LLM.chat answers for the same (regenerated) history; kill -9 and rerun gives every id once with
no torn line; `vx extract` of the output puts exactly the regenerated text under the loss mask."""

import json
import os
import signal
import subprocess
import sys
import time

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
    # one sequence at a time, as LLM.chat below runs them: bf16 GEMMs on CPU round differently with
    # the batch's size, and greedy decoding of a random model's near-tied logits follows that rounding
    # (a turn diverged from LLM.chat at its 11th token with the three conversations side by side)
    r = vx_cmd("regenerate", str(data), "-o", str(d / "r.jsonl"), "--max-tokens", str(MAX_TOKENS), "--json",
               "--max-num-seqs", "1")
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


def test_a_killed_driver_or_engine_and_sigterm_to_the_group_then_a_rerun_give_every_id_once(tmp_path, tiny_model):
    """The driver and its reaper killed together (kill -9 of every vx process by name, after its
    first fsynced chunk, then a torn line appended): the engine still ends within 10 s; the engine
    core killed under a live driver (exit 3 within 10 s, one line, nothing committed after its
    death); SIGTERM to the whole process group (exit 143 within 10 s); no process left after any;
    the rerun then writes every conversation once, and every line parses."""
    from test_engine_lifetime import BOUND_S, assert_one_line, follow, kill9_and_wait, launch, wait_gone
    import procfs  # tests/procfs.py

    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question number {i}"}]} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    result, cache = tmp_path / "r.jsonl", tmp_path / "cache"
    args = [sys.executable, "-m", "vx", "regenerate", str(data), "-o", str(result),
            "--max-tokens", "6", "--commit-every", "4", "--max-num-seqs", "4"]

    def lines() -> int:
        return sum(1 for _ in open(result)) if result.exists() else 0

    p = launch(args, cache)
    reapers, killed_at = [], []

    def kill_all(_engine: int) -> None:  # `pkill -9 -f vx`: the reaper (a session of its own) dies too
        reapers.extend(r for r in procfs.children(p.pid) if b"vx.engine.lifetime.reaper" in procfs.cmdline(r))
        for pid in reapers + [p.pid]:
            os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    follow(p, until=lambda: lines() >= 4, act=kill_all)  # its read of the pipes ends with the engine
    assert p.returncode == -9 and reapers
    wait_gone(p.pid, within_s=BOUND_S)
    took = time.monotonic() - killed_at[0]  # the engine's workers watch the driver themselves
    print(f"engine gone {took:.2f} s after its driver and reaper")
    assert took < BOUND_S, f"the engine outlived its driver and reaper by {took:.1f} s"
    first = [json.loads(x)["id"] for x in open(result)]
    assert 0 < len(first) < len(rows)  # killed mid-run
    with open(result, "ab") as f:  # a crash mid-append leaves a torn line
        f.write(b'{"id": "c99", "messa')

    p = launch(args, cache)  # the engine core killed once this run committed a chunk of its own
    dead = {}
    exited, _, stderr = follow(p, until=lambda: lines() > len(first) + 1,
                               act=lambda pid: dead.update(kill9_and_wait(pid, writer_in_worker=False), lines=lines()))
    assert p.returncode == 3, stderr[-3000:]
    assert_one_line(stderr)
    assert "committed conversations are kept" in stderr and exited - dead["t"] < BOUND_S
    wait_gone(p.pid)
    # the driver may still write what it received before the death (nothing finished is lost), but
    # it generates nothing more: at most the unwritten chunk and the 4 sequences in flight
    assert lines() - dead["lines"] <= 4 + 4, ("went on after the engine died", dead["lines"], lines())
    done = lines()

    p = launch(args, cache)
    sent = {}

    def term_group(pid):
        os.killpg(p.pid, signal.SIGTERM)
        sent["t"] = time.monotonic()

    exited, _, stderr = follow(p, until=lambda: lines() > done, act=term_group)
    assert p.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted; rerun the same command" in stderr
    assert exited - sent["t"] < BOUND_S
    wait_gone(p.pid)
    assert lines() < len(rows) + 1  # it was stopped before the end

    again = subprocess.run(args + ["--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    s = json.loads(again.stdout)
    ids = [json.loads(x)["id"] for x in open(result).read().splitlines()]  # every line parses: the torn one is gone
    assert sorted(ids) == sorted(r["id"] for r in rows), "lost or duplicated conversations"
    assert s["conversations"] + s["skipped"] == len(rows)


def test_a_failed_fsync_of_a_chunk_never_writes_that_chunk_twice(tmp_path, monkeypatch):
    """The fault campaign's trial 156 of seed 41 (`vx regenerate`, ENOSPC before the committed
    mark): the failed chunk was written again when the output closed, so a rerun found four
    conversations twice. Here the disk fails the chunk's fsync once; the run stops, closes, and
    a second writer continues: every conversation once."""
    import errno

    from vx.store.text_output import RegenOutput, committed_ids

    path = tmp_path / "r.jsonl"
    out = RegenOutput(path)
    real_fsync, failed = os.fsync, []

    def full_disk_once(fd):
        if not failed:
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_once)
    for i in range(3):
        out.add({"id": f"c{i}", "messages": []}, every=10)
    with pytest.raises(OSError):
        out.commit()
    out.close()  # what the run's cleanup does after the error
    again = RegenOutput(path)
    for i in range(3, 6):
        if f"c{i}" not in again.done:
            again.add({"id": f"c{i}", "messages": []}, every=10)
    again.close()
    ids = [json.loads(x)["id"] for x in path.read_text().splitlines()]
    assert sorted(ids) == sorted(set(ids)) and set(ids) == committed_ids(path)
    assert {f"c{i}" for i in range(3, 6)} <= set(ids)


def test_a_partition_starting_while_another_merges_waits_for_the_merge_and_a_second_writer_is_refused(tmp_path):
    """The fault campaign's trial 24 of seed 52 (`vx regenerate --dp 2`, a kill after the merge's
    fsync): in the rerun, partition 0 had nothing left and merged the parts while partition 1's
    worker started; it found its part locked by the merge and failed ("being written by another").
    A launcher's workers no longer merge (the launcher does, once all are done), and a part's writer
    (e.g. a SLURM array task) waits for a merge that holds its part: only a writer is refused."""
    import threading

    from vx.errors import UsageError
    from vx.store.text_output import RegenOutput, part_path, sidecar
    from vx.store.lock import try_lock

    merged = tmp_path / "r.jsonl"
    part = part_path(merged, 1, 2)
    part.parent.mkdir(parents=True)
    merge_lock, _ = try_lock(sidecar(merged, ".lock"))  # what merge_parts holds while it merges
    part_lock, _ = try_lock(sidecar(part, ".lock"))
    released = threading.Event()

    def merge_ends():
        part_lock.close()
        merge_lock.close()
        released.set()

    threading.Timer(1.0, merge_ends).start()
    writer = RegenOutput(part, merged=merged)
    assert released.is_set()  # it opened once the merge let go, not before
    with pytest.raises(UsageError, match="being written by another vx regenerate"):
        RegenOutput(part, merged=merged)  # a live writer, and no merge: refused at once
    writer.close()
