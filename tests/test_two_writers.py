"""Two writers, one S3 output: the second attempt of a partition (a Ray retry beside a first
attempt that a partition or a hang only paused, a requeued SLURM job, the same command started on
two machines) takes the prefix over, and the first one, woken, stops at its next S3 step with one
line naming the owner, leaving nothing behind. Whatever each printed, the output is whole: every
sample once, every listed shard's bytes those its manifest says, nothing else under the prefix,
every row the per-sample HF forward's.

The two attempts run from two staging directories (two hosts' vx caches) against moto's S3 server
over HTTP. The first is stalled by a failpoint before its fourth shard's upload (three uploaded and
checked, not all listed yet), and woken once the second has finished. The second writes with a smaller --shard-size, so
that its shards hold other samples than the first's under the same numbers, as vLLM's batching
makes them in a real rerun (the HF backend is deterministic: equal settings would give equal bytes
and hide a clobbered key). Checks are tests/fault_checks.py's own reading of the objects.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, machine_cache
from test_s3 import CREDS, s3_server  # noqa: F401  (the fixture)


import fault_checks as checks  # noqa: E402

ROWS = 24


def chats(n: int) -> list[dict]:
    import random

    rng = random.Random(7)
    words = "two writers one output fence lease owner shard manifest retry partition heal".split()
    return [{"id": f"w{i}", "messages": [
        {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(4, 18)))},
        {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(4, 40)))}]} for i in range(n)]


def extract(data, out, cache, *extra, env=None, wait=True):
    cmd = [sys.executable, "-m", "vx", "extract", str(data), "-o", str(out), "--backend", "hf", "--batch-size", "4",
           "--json", "--progress-every", "1000", *extra]
    e = dict(os.environ, **CREDS, VX_CACHE_DIR=machine_cache(cache), OMP_NUM_THREADS="1", **(env or {}))
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=e, timeout=600)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=e)


def wait_for(pred, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def chats_and_rows(tmp_path_factory):
    """The dataset, and every sample's rows from a clean local run of it: what each output is held against."""
    base = tmp_path_factory.mktemp("two-writers")
    data = base / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats(ROWS)))
    ref = extract(data, base / "ref", base / "cache-ref")
    assert ref.returncode == 0, ref.stderr
    files = checks.Output.local(base / "ref")
    _, headers = checks.checksums_pass(files)
    return data, {k: v for name, h in headers.items() for k, v in checks.rows_of(files.files[name], h).items()}


def test_a_paused_writer_woken_after_its_successor_finished_corrupts_nothing(s3_server, chats_and_rows, tmp_path):
    """One partition of a 2-way run, as a Ray retry or a requeued array task meets it (the fault
    campaign's two-writers mode runs whole outputs and partitions alike, hf and vLLM)."""
    url, client = s3_server
    data, reference = chats_and_rows
    prefix = "two"
    target = f"s3://vx-out/{prefix}"
    where = ["--endpoint-url", url, "--num-partitions", "2", "--partition-index", "0"]

    wake, trace = tmp_path / "wake", tmp_path / "trace-a"
    first = extract(data, target, tmp_path / "host-a", "--shard-size", "0.3", *where, wait=False,
                    env={"VX_FAULT": "before-upload:4:stall", "VX_FAULT_STALL_UNTIL": str(wake),
                         "VX_FAULT_STALL_S": "400", "VX_FAULT_TRACE": str(trace)})
    try:
        wait_for(lambda: trace.exists() and "fired before-upload" in trace.read_text() or first.poll() is not None,
                 "the first attempt to pause before its fourth upload")
        assert first.poll() is None, first.communicate()[1][-2000:]
        second = extract(data, target, tmp_path / "host-b", "--shard-size", "0.2", *where)
        wake.touch()
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 0, second.stderr[-2000:]
    assert first.returncode == 4, (first.returncode, err[-2000:])
    part = "part-00000-of-00002/"
    owner = json.loads(client.get_object(Bucket="vx-out", Key=f"{prefix}/{part}.vx-owner.json")["Body"].read())
    last = err.strip().splitlines()[-1]
    assert last.startswith("vx: ") and "Traceback" not in err, err[-2000:]
    assert f"{target}/{part}".rstrip("/") in last and "taken over by another writer" in last, last
    assert f"pid {owner['pid']} on {owner['host']}" in last and f"attempt {owner['attempt']}" in last, last
    rest = extract(data, target, tmp_path / "host-b", "--shard-size", "0.2", "--endpoint-url", url,
                   "--num-partitions", "2", "--partition-index", "1")  # then the whole output holds every sample once
    assert rest.returncode == 0, rest.stderr[-2000:]

    files = checks.Output.s3(client, "vx-out", prefix)
    bad = checks.exactly_once(files, [r["id"] for r in chats(ROWS)])
    sums, headers = checks.checksums_pass(files)
    bad += sums + checks.states_match(files, headers, reference, 0.999)
    bad += checks.s3_listing_agrees(files, client, "vx-out", prefix)
    assert not bad, bad
    verify = subprocess.run([sys.executable, "-m", "vx", "verify", target, "--endpoint-url", url], capture_output=True,
                            text=True, cwd=ROOT, env=dict(os.environ, **CREDS), timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_local_output_on_a_shared_filesystem_refuses_a_writer_on_another_host(tmp_path):
    """flock may not reach across the hosts of an NFS or Lustre mount: the output's lock also
    records its holder with a heartbeat. A fresh heartbeat of another host's writer refuses a
    second writer in one line before anything is touched; a stale one (a host that died) does
    not; a running writer keeps its heartbeat fresh and clears the record when it ends."""
    import socket

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats(4)))
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".vx-lock"
    lock.write_text(json.dumps({"pid": 4242, "host": "node-17", "heartbeat": time.time() - 5}) + "\n")
    r = extract(data, out, tmp_path / "cache")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vx: ") and "pid 4242 on node-17" in last and "another host" in last, last
    assert sorted(p.name for p in out.iterdir()) == [".vx-lock"]  # nothing else touched

    lock.write_text(json.dumps({"pid": 4242, "host": "node-17", "heartbeat": time.time() - 120}) + "\n")
    wake, trace = tmp_path / "wake", tmp_path / "trace"
    run = extract(data, out, tmp_path / "cache", wait=False,
                  env={"VX_LOCK_HEARTBEAT_S": "0.3", "VX_FAULT": "after-batch:1:stall", "VX_FAULT_STALL_UNTIL": str(wake),
                       "VX_FAULT_STALL_S": "300", "VX_FAULT_TRACE": str(trace)})
    try:
        wait_for(lambda: trace.exists() and "fired after-batch" in trace.read_text() or run.poll() is not None,
                 "the writer to pause after its first batch")
        first = json.loads(lock.read_text())
        time.sleep(1.5)
        second = json.loads(lock.read_text())
        assert first["host"] == socket.gethostname() and first["pid"] == run.pid
        assert second["heartbeat"] - first["heartbeat"] >= 0.9  # beating while the writer is paused
        wake.touch()
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-2000:]
    assert lock.read_text() == ""  # let go: another host may start at once
