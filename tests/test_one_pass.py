"""`vx extract DATA -o OUT --regenerate`: the target writes the assistant turns and the states of
the regenerated conversations are captured in the same run, exactly once across a SIGTERM as its
engines start and a kill -9 mid-run.

Held against what is independent of vx's code: the conversations the run wrote, rendered by the
tokenizer's own chat template (transformers' apply_chat_template) for the stored ids, and an fp32
HF forward with output_hidden_states for the stored states.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import vx
from vx.data.follow import committed_bytes

ROOT = Path(__file__).resolve().parents[1]
import procfs  # noqa: E402
LAYERS = [1, 3, 5]


def one_pass(out: Path, *extra: str, backend: str = "vllm", data: str = "examples/chat.jsonl") -> list[str]:
    return [sys.executable, "-m", "vx", "extract", data, "-o", str(out), "--regenerate",
            "--backend", backend, "--max-tokens", "12", "--temperature", "0.8", "--seed", "7", "--shard-size", "0.05",
            "--layers", ",".join(map(str, LAYERS)), "--json", *extra]


def committed_lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip()) if path.exists() else 0


def regeneration_engine_core(driver: int) -> int | None:
    """The engine core of the one-pass driver's regeneration (its child's), if it runs."""
    for child in procfs.children(driver):
        if b"vx.jobs.regeneration" in procfs.cmdline(child):
            for pid in procfs.children(child):
                if procfs.cmdline(pid).startswith(b"VLLM::EngineCore"):
                    return pid
    return None


def sigterm_as_the_capture_engine_starts(out: Path) -> None:
    """The fault campaign's trial 119 (seed 50): SIGTERM to the driver as its own engine core
    (the capture's) appears, beside the held regeneration's. It came back as the capture's normal
    end and the driver released the regeneration and waited on it (> 60 s). Now: exit 143 and
    one line within 60 s, and every process of the run gone."""
    tag = f"VX_TEST_RUN={out.parent.name}-{time.monotonic_ns()}"
    env = dict(os.environ, **dict([tag.split("=", 1)]))
    p = subprocess.Popen(one_pass(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=env)
    deadline = time.monotonic() + 900  # two engines start on a loaded machine: wait for the event
    while p.poll() is None and time.monotonic() < deadline and not any(
            procfs.cmdline(c).startswith(b"VLLM::EngineCore") for c in procfs.children(p.pid)):
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1][-3000:]
    os.kill(p.pid, signal.SIGTERM)
    sent = time.monotonic()
    stderr = procfs.stderr_within(p, "SIGTERM to the one-pass driver")
    assert p.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "vx: interrupted; rerun the same command to continue", stderr[-3000:]
    while procfs.tagged(tag.encode()):  # the regeneration's process and both engines
        assert time.monotonic() - sent < 90, f"left running: {procfs.tagged(tag.encode())}"
        time.sleep(0.2)


def test_sigterm_as_the_engine_starts_then_a_kill_9_mid_run_then_a_rerun_leave_every_conversation_once(
        tmp_path, tiny_model, tokenizer, fp32_model):
    out = tmp_path / "out"
    manifest, regen = out / "manifest.jsonl", out / "regenerated.jsonl"
    sigterm_as_the_capture_engine_starts(out)
    # the first run as on a GPU: the capture follows the regeneration (here on halves of the cores),
    # so the kill lands with both mid-run; the rerun as on CPU: the capture after the regeneration
    following = dict(os.environ, VX_ONE_PASS_CORES="split")
    first = subprocess.Popen(one_pass(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env=following)
    deadline = time.monotonic() + 900  # two engines start on a loaded machine: wait for events, not seconds
    while time.monotonic() < deadline and first.poll() is None and committed_lines(manifest) < 2:
        time.sleep(0.2)
    assert first.poll() is None, first.communicate()[1].decode()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # the driver, and with it the regeneration and both engines
    first.wait()
    captured_before = committed_lines(manifest)
    assert 0 < captured_before

    r = subprocess.run(one_pass(out, "--verify", "4"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["regenerated"]["skipped"] > 0  # the rerun continued the conversations already written
    assert summary["verify"]["ok"] and summary["verify"]["samples_checked"] == 4  # --verify covers this mode

    records = [json.loads(line) for line in (ROOT / "examples/chat.jsonl").read_text().splitlines() if line]
    want = [r["id"] for r in records if "messages" in r or "conversations" in r]  # text records have no turns
    assert 0 < len(want) < len(records)
    convs = [json.loads(line) for line in regen.read_text().splitlines() if line.strip()]
    assert sorted(c["id"] for c in convs) == sorted(want)  # every conversation once in the text
    ds = vx.open_dataset(out)
    assert sorted(ds.ids) == sorted(want)  # and once in the states
    assert len(set(ds.ids)) == len(ds.ids)

    model = fp32_model
    for c in convs:
        rendered = tokenizer.apply_chat_template(c["messages"], tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        rec = ds[c["id"]]
        assert rec["input_ids"].tolist() == ids, c["id"]  # the rows of the regenerated text, nothing else
        if c["id"] in want[:6]:  # and those rows' states are the target's, within the product's bound
            with torch.inference_mode():
                hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            ref = torch.stack([hs[k + 1][0] for k in LAYERS], dim=1)  # [T, L, H]
            got = rec["hidden_states"].float()
            for j in range(len(LAYERS)):
                cos = torch.nn.functional.cosine_similarity(got[:, j].flatten(), ref[:, j].flatten(), dim=0)
                assert cos >= 0.999, (c["id"], LAYERS[j], float(cos))
            assert (got.abs().amax(dim=(1, 2)) > 0).all()  # no zero row


def test_the_regeneration_engine_killed_once_every_conversation_is_committed_costs_the_run_nothing(tmp_path):
    """On CPU the regeneration's engine idles until the capture is done, then stops beside vx's
    engine (vx/jobs/one_pass.py). Killed in that wait, every conversation committed, its death
    loses nothing: the run ends 0 with every conversation's text and states. A rerun of the
    finished output has nothing to do and starts no engine at all."""
    records = [line for line in (ROOT / "examples/chat.jsonl").read_text().splitlines()
               if line and ("messages" in json.loads(line) or "conversations" in json.loads(line))][:8]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(records) + "\n")
    out = tmp_path / "out"
    regen = out / "regenerated.jsonl"
    # the capture's first shard commit stalls 8 s: past the 6 s a watched engine's death gives its driver
    stall = dict(os.environ, VX_FAULT="after-manifest:1:stall", VX_FAULT_STALL_S="8")
    run = subprocess.Popen(one_pass(out, data=str(data)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True, env=stall)
    deadline, killed = time.monotonic() + 900, None  # two engines start on a loaded machine: wait for events
    while run.poll() is None and time.monotonic() < deadline and killed is None:
        if committed_lines(regen) == len(records) and committed_bytes(regen) == regen.stat().st_size:
            killed = regeneration_engine_core(run.pid)
            if killed:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    assert killed, "the regeneration's engine had stopped before the capture was done"
    assert "Traceback" not in stderr, stderr[-3000:]
    want = sorted(json.loads(line)["id"] for line in records)
    assert sorted(json.loads(line)["id"] for line in regen.read_text().splitlines() if line.strip()) == want
    assert sorted(vx.open_dataset(out).ids) == want
    assert json.loads(stdout)["regenerated"]["conversations"] == len(records)

    again = subprocess.Popen(one_pass(out, data=str(data)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    engines = set()
    while again.poll() is None:
        engines |= {pid for pid in procfs.descendants(again.pid) if procfs.cmdline(pid).startswith(b"VLLM::")}
        time.sleep(0.02)
    stdout, stderr = again.communicate(timeout=900)
    assert again.returncode == 0, stderr[-3000:]
    assert not engines, "a rerun with nothing to do started a vLLM engine"
    summary = json.loads(stdout)
    assert summary["regenerated"]["skipped"] == len(records) and summary["regenerated"]["conversations"] == 0
    assert sorted(vx.open_dataset(out).ids) == want


def test_two_slots_to_s3_killed_mid_run_then_a_rerun_on_another_machine_keep_each_conversations_text_with_its_states(
        tmp_path, tiny_model, tokenizer):
    """--data-parallel-size 2 to s3://: each slot regenerates its partition and captures it (here
    with the hf backend: the partitioning and S3 are under test, the vLLM capture is above); S3 is
    the output, the local directory only staging. kill -9 of the launcher's group once S3 holds a
    committed shard: nothing of the run is left running. The text of a conversation goes to S3
    before its states do, so a rerun on a machine without the staging (an empty vx cache) takes the
    text of every conversation S3 holds states of from S3, regenerates the rest and merges the
    parts into one regenerated.jsonl. Held against S3's own listing and the tokenizer's rendering
    of S3's text. No --seed: a conversation regenerated again gets other text, so states kept with
    the wrong text show."""
    from conftest import machine_cache
    from s3_faults import free_port
    from test_s3 import CREDS, download, start_s3_process

    proc, url, client = start_s3_process(free_port())
    try:
        def unseeded(*extra: str) -> list[str]:
            cmd = one_pass("s3://vx-out/one", "--endpoint-url", url, "--data-parallel-size", "2", *extra, backend="hf")
            i = cmd.index("--seed")
            return cmd[:i] + cmd[i + 2:]

        tag = f"VX_TEST_RUN={tmp_path.name}-{time.monotonic_ns()}"
        first = subprocess.Popen(unseeded(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True,
                                 env=dict(os.environ, **CREDS, **dict([tag.split("=", 1)]),
                                          VX_CACHE_DIR=machine_cache(tmp_path / "machine-a"),
                                          VX_ONE_PASS_CORES="split"))  # the capture follows the regeneration

        def published() -> int:  # committed shards in S3, over both partitions' manifests
            n = 0
            for obj in client.list_objects_v2(Bucket="vx-out", Prefix="one/").get("Contents", []):
                if obj["Key"].endswith("/manifest.jsonl"):
                    body = client.get_object(Bucket="vx-out", Key=obj["Key"])["Body"].read()
                    n += sum(1 for line in body.splitlines() if line.strip())
            return n

        deadline = time.monotonic() + 900  # engines start on a loaded machine: wait for events, not seconds
        while time.monotonic() < deadline and first.poll() is None and published() < 1:
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()[1].decode()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)  # the launcher; its workers, their regenerations and engines die with it
        first.wait()
        killed = time.monotonic()
        while procfs.tagged(tag.encode()):
            assert time.monotonic() - killed < 90, f"left running: {procfs.tagged(tag.encode())}"
            time.sleep(0.2)
        early = download(client, "vx-out", "one", tmp_path / "early")
        states_then = {sid for name in early if name.endswith("manifest.jsonl")
                       for line in (tmp_path / "early" / name).read_text().splitlines() if line
                       for sid in json.loads(line)["sample_ids"]}
        text_then = {}  # the first run's text in S3, a later segment's line replacing an earlier one's
        for name in sorted(n for n in early if n.startswith("regenerated.jsonl.d/")):
            for line in (tmp_path / "early" / name).read_text().splitlines():
                text_then[json.loads(line)["id"]] = line
        assert states_then and states_then <= text_then.keys()  # no state in S3 before its text

        r = subprocess.run(unseeded("--verify", "2"), cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, **CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "machine-b")))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "restored from it" in r.stderr, r.stderr[-3000:]
        summary = json.loads(r.stdout)
        assert [p["partition"] for p in summary["partitions"]] == [0, 1]
        assert summary["verify"]["ok"] and summary["regenerated"]["output"] == "s3://vx-out/one/regenerated.jsonl"

        names = download(client, "vx-out", "one", tmp_path / "s3")
        assert len([n for n in names if n.startswith("regenerated.jsonl.d/")]) == 1  # the runs' segments compacted
        records = [json.loads(line) for line in (ROOT / "examples/chat.jsonl").read_text().splitlines() if line]
        want = sorted(r["id"] for r in records if "messages" in r or "conversations" in r)
        convs = [json.loads(line) for line in (tmp_path / "s3" / "regenerated.jsonl").read_text().splitlines()
                 if line.strip()]
        assert sorted(c["id"] for c in convs) == want  # every conversation once in S3's text
        assert summary["regenerated"]["conversations_in_output"] == len(want)
        final = {json.loads(line)["id"]: line for line in (tmp_path / "s3" / "regenerated.jsonl").read_text().splitlines()
                 if line.strip()}
        assert all(final[i] == text_then[i] for i in states_then)  # the text the first run's states are of
        ds = vx.open_dataset(tmp_path / "s3")
        assert sorted(ds.ids) == want  # and once in its states, whichever slot wrote them
        for c in convs:  # each conversation's rows are those of S3's text of it
            rendered = tokenizer.apply_chat_template(c["messages"], tokenize=False)
            assert ds[c["id"]]["input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    finally:
        proc.kill()


def bad_lines(data: Path = ROOT / "examples/chat.jsonl") -> list[int]:
    """The 1-based lines of data that hold no conversation: what the regeneration must report."""
    lines = data.read_text().splitlines()
    return [i for i, line in enumerate(lines, 1) if line.strip() and not {"messages", "conversations"} & set(json.loads(line))]


def reported_lines(errors: Path) -> list[int]:
    return sorted(json.loads(line)["line"] for line in errors.read_text().splitlines() if line.strip())


def test_partitions_run_in_any_order_on_two_machines_to_s3_and_the_last_writes_one_text_with_every_bad_record(
        tmp_path, tiny_model, tokenizer):
    """--num-partitions 2 --partition-index i, as SLURM array tasks on two machines (each its own
    staging) to one s3:// output, partition 1 first: each job regenerates and captures its
    token-balanced share; the last to end writes S3's regenerated.jsonl, every conversation once
    and its stored ids its text's, and S3's errors file every bad record of the input once, those
    of the other machine's partition too (its disk may be gone)."""
    from conftest import machine_cache
    from s3_faults import free_port
    from test_s3 import CREDS, download, start_s3_process

    proc, url, client = start_s3_process(free_port())
    try:
        summaries = []
        for i in (1, 0):
            r = subprocess.run(one_pass("s3://vx-out/parts", "--endpoint-url", url, "--num-partitions", "2",
                                        "--partition-index", str(i), backend="hf"),
                               cwd=ROOT, capture_output=True, text=True, timeout=900,
                               env=dict(os.environ, **CREDS, VX_CACHE_DIR=machine_cache(tmp_path / f"machine-{i}")))
            assert r.returncode == 0, r.stderr[-3000:]
            summaries.append(json.loads(r.stdout)["regenerated"])
        assert [s["merged"] for s in summaries] == [False, True]
        download(client, "vx-out", "parts", tmp_path / "s3")
        records = [json.loads(line) for line in (ROOT / "examples/chat.jsonl").read_text().splitlines() if line]
        want = sorted(r["id"] for r in records if "messages" in r or "conversations" in r)
        convs = [json.loads(line) for line in (tmp_path / "s3" / "regenerated.jsonl").read_text().splitlines()
                 if line.strip()]
        ds = vx.open_dataset(tmp_path / "s3")
        assert sorted(c["id"] for c in convs) == want == sorted(ds.ids)
        assert summaries[1]["conversations_in_output"] == len(want)
        assert 0 < summaries[0]["conversations"] < len(want)  # each job its own share
        for c in convs:
            rendered = tokenizer.apply_chat_template(c["messages"], tokenize=False)
            assert ds[c["id"]]["input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert reported_lines(tmp_path / "s3" / "regenerated.jsonl.errors.jsonl") == bad_lines()
    finally:
        proc.kill()


def test_a_followed_input_yields_committed_rows_only_and_after_its_end_when_asked(tmp_path):
    from vx.data.follow import FollowingInput
    from vx.data.samples import PENDING

    path = tmp_path / "regenerated.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c"')  # c is not committed (no newline, past the mark)
    (tmp_path / "regenerated.jsonl.committed").write_text(str(len('{"id": "a"}\n{"id": "b"}\n')))
    done = {"now": False}

    def ids(after_end: bool, limit: int = 5) -> list:
        got = []
        for row in FollowingInput(path, lambda: done["now"], pending=True, after_end=after_end).rows():
            got.append("PENDING" if row is PENDING else row.record["id"])
            if len(got) == limit:
                break
        return got

    assert ids(False) == ["a", "b", "PENDING", "PENDING", "PENDING"]  # following: as they commit
    assert ids(True, 3) == ["PENDING"] * 3                             # after the end: nothing before it
    done["now"] = True
    assert ids(True) == ["a", "b"]  # the writer is done: every committed row, then the input ends


def test_beside_a_starting_capture_engine_the_regeneration_keeps_its_engine_until_that_start_is_over():
    """vLLM fails an engine whose free device memory rises while it profiles (0.33's
    determine_available_memory, "Error in memory profiling"). Where the capture's engine starts
    beside the generation (a GPU), the regeneration, every conversation committed, waits before
    stopping its engine for the driver's word that the capture's engine has started ("go", said
    by Regeneration.release() from the capture's started callback), or for the driver's end;
    held (CPU), for the capture's end. Over a real pipe, in the order the driver writes."""
    import os
    import threading

    from vx.jobs.regeneration import before_stop

    def waits_until(hold, keep, lines: list[str], close: bool) -> list[str]:
        r, w = os.pipe()
        stdin, writer = os.fdopen(r), os.fdopen(w, "w")
        order, wait = [], before_stop(hold, keep, stdin)
        t = threading.Thread(target=lambda: (wait(), order.append("engine stops")))
        t.start()
        for line in lines:
            t.join(0.3)  # a waiting engine does not stop before the driver's next word
            order.append(f"driver says {line!r}")
            writer.write(line + "\n")
            writer.flush()
        t.join(0.3)
        if close:
            order.append("driver ends")
            writer.close()
        t.join(60)
        assert not t.is_alive()
        stdin.close()
        return order

    assert before_stop(False, False, None) is None  # nothing beside it: it stops at once
    # kept: the max_model_len line changes nothing, "go" (the capture's engine started) releases it
    assert waits_until(False, True, ["1040", "go"], close=False) == [
        "driver says '1040'", "driver says 'go'", "engine stops"]
    # a driver that ends (stopped, or a capture with nothing to do) releases it too
    assert waits_until(False, True, [], close=True) == ["driver ends", "engine stops"]
    # held: "go" starts the generation; the engine stops only at the capture's end
    assert waits_until(True, False, ["go"], close=True) == ["driver says 'go'", "driver ends", "engine stops"]
