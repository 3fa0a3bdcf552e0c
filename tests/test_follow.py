"""Training while vx extracts: `vx extract --dp 2 --retain-gb` writes to S3 (moto over HTTP) while
`torchrun --nproc_per_node 2 examples/train_draft.py --follow` trains on the shards as they are
committed. The extraction is killed with SIGKILL and rerun, one trainer rank is killed with
SIGKILL and the trainers restart from their checkpoints; every sample is still trained on exactly
once (counted from the trainers' own per-step traces, against the dataset's ids), both ranks take
the same number of steps, the first step comes before the extraction ends, the S3 prefix never
holds more shard bytes than the bound plus one shard per writer, and nothing is deleted before
every rank committed it. The follow plan itself (local): the same in every rank for (seed,
window), states equal to vx.open_dataset's, exact resume mid-window, a rank ahead waits and
times out naming the shard."""

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd
from test_s3 import CREDS, start_s3

import vx
import vx.errors

LAYERS = "1,3"  # two layers of the tiny model: ~1 KB per token, so thousands of samples stay small


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i} " + "word " * rng.randint(2, 12)},
        {"role": "assistant", "content": "answer " * rng.randint(2, 24)}]} for i in range(n)]


@pytest.fixture(scope="module")
def growing(tmp_path_factory, tiny_model):
    """A local output whose extraction is complete, for the plan's properties."""
    d = tmp_path_factory.mktemp("follow")
    data = write_jsonl(d / "d.jsonl", chats(160))
    r = vx_cmd("extract", str(data), "-o", str(d / "out"), "--backend", "hf", "--dp", "2", "--shard-size", "0.03",
               "--layers", LAYERS, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return d / "out"


def epoch_of(path, rank, world=2, **kw) -> list[dict]:
    return list(vx.loader(str(path), 400, rank=rank, world_size=world, seed=5, follow=True, shuffle_shards=3, **kw))


def test_every_rank_plans_alike_and_reads_every_sample_once_with_vx_readers_states(growing):
    ds = vx.open_dataset(growing)
    ranks = [epoch_of(growing, r) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) > 5
    seen = collections.Counter(s for batches in ranks for b in batches if not b["padding"] for s in b["sample_ids"])
    assert set(seen) == set(ds.ids) and max(seen.values()) == 1
    b = ranks[1][3]
    want = torch.cat([ds[s]["hidden_states"] for s in b["sample_ids"]])
    assert torch.equal(b["hidden_states"], want)
    again = epoch_of(growing, 1)  # the same plan from (seed, window), in another reader
    assert [x["sample_ids"] for x in again] == [x["sample_ids"] for x in ranks[1]]
    later = vx.loader(str(growing), 400, rank=1, world_size=2, seed=5, follow=True, shuffle_shards=3)
    later.set_epoch(1)  # the shards were kept: epoch 2 is the finished output's whole-epoch plan
    plain = vx.loader(str(growing), 400, rank=1, world_size=2, seed=5, shuffle_shards=3, epoch=1)
    assert [b.samples.tolist() for b in later.batches()] == [b.samples.tolist() for b in plain.batches()]


def test_a_resumed_follow_reader_continues_exactly_mid_window(growing):
    full = epoch_of(growing, 0)
    first = vx.loader(str(growing), 400, rank=0, world_size=2, seed=5, follow=True, shuffle_shards=3)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    resumed = vx.loader(str(growing), 400, rank=0, world_size=2, seed=5, follow=True, shuffle_shards=3)
    resumed.load_state_dict(state)
    assert [b["sample_ids"] for b in resumed] == [b["sample_ids"] for b in full[4:]]


def test_a_rank_ahead_waits_then_names_the_shard_it_waits_for(growing, tmp_path):
    import shutil

    from vx.errors import VxError

    cut = tmp_path / "cut"
    shutil.copytree(growing, cut)
    for part in sorted(cut.glob("part-*")):  # partition 1 "still running": half its shards, no end
        (part / "end.json").unlink()
    lines = (cut / "part-00001-of-00002" / "manifest.jsonl").read_text().splitlines(keepends=True)
    (cut / "part-00001-of-00002" / "manifest.jsonl").write_text("".join(lines[: len(lines) // 2]))
    t0 = time.monotonic()
    with pytest.raises(VxError, match=r"waited 2 s for shard #\d+ of part-0000\d-of-00002"):
        epoch_of(cut, 0, follow_timeout=2)
    assert time.monotonic() - t0 < 30


def test_a_retain_bound_smaller_than_a_window_is_named_instead_of_a_silent_deadlock(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", chats(200))
    ex = run_bg([sys.executable, "-m", "vx", "extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf",
                 "--layers", LAYERS, "--shard-size", "0.03", "--retain-gb", "0.0003"], dict(os.environ),
                tmp_path / "extract.log")
    manifest = tmp_path / "out" / "manifest.jsonl"
    try:
        while not (manifest.exists() and manifest.stat().st_size):  # its first shard: the writer is past its start
            assert ex.poll() is None, (tmp_path / "extract.log").read_text()[-2000:]
            time.sleep(0.1)
        # the reader names the bound once nothing new came for half its follow_timeout (here 10 s:
        # the writer, past its start, commits a shard every second or less until it is held)
        with pytest.raises(vx.errors.UsageError, match=r"--retain-gb 0.0003 lets each of its 1 writers hold .* "
                                                       r"raise --retain-gb, lower shuffle_shards"):
            list(vx.loader(str(tmp_path / "out"), 400, follow=True, shuffle_shards=40, follow_timeout=20))
        assert ex.poll() is None  # the extraction waits for readers: nothing unconsumed was deleted
        assert not (tmp_path / "out" / "dropped.jsonl").exists()
    finally:
        os.killpg(ex.pid, signal.SIGKILL)
        ex.wait()


def test_a_failed_partition_under_a_retain_bound_stops_the_others_and_the_rerun_streams_every_sample_once(tmp_path,
                                                                                                        tiny_model):
    """The fault campaign's trial 36 of seed 49 (--dp 2 --retain-gb, a follow reader, SIGTERM to
    one partition worker): the launcher waited for the other partition, whose writer waited at its
    bound for readers that wait for the failed partition's next shard: no end. Now the others are
    stopped as Ctrl-C stops them (committed shards kept), the run ends with one line naming both,
    and the same command with a reader finishes it: every sample once."""
    data = write_jsonl(tmp_path / "d.jsonl", chats(120))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vx", "extract", str(data), "-o", str(out), "--backend", "hf", "--dp", "2",
           "--layers", LAYERS, "--shard-size", "0.03", "--retain-gb", "0.0003", "--json"]
    env = dict(os.environ, VX_FAULT="after-manifest:1", VX_FAULT_PARTITION="0")  # killed after its first commit
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and line.startswith("vx: error: 2 of 2 partitions failed"), r.stderr[-3000:]
    assert "partition 0 (exit -9" in line and "partition 1 (stopped: under --retain-gb" in line, line
    assert "rerun the same command" in line

    again = run_bg(cmd, dict(os.environ), tmp_path / "rerun.log")
    seen = collections.Counter()
    try:
        ld = vx.loader(str(out), 400, follow=True, shuffle_shards=2, follow_timeout=600)
        for b in ld:
            seen.update(s for s in b["sample_ids"] if not b["padding"])
            ld.commit(ld.state_dict())  # what the writers wait for under the bound
        assert again.wait(timeout=600) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert sorted(seen) == sorted(f"c{i}" for i in range(120)) and max(seen.values()) == 1


def run_bg(args, env, log):
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def shard_objects(client, prefix) -> tuple[int, int]:
    """(bytes, count) of the shard objects under the prefix now."""
    total = count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="vx-out", Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            if o["Key"].rsplit("/", 1)[-1].startswith("shard-"):
                total += o["Size"]
                count += 1
    return total, count


def committed_shards(client, prefix) -> int:
    n = 0
    for p in ("part-00000-of-00002", "part-00001-of-00002"):
        try:
            body = client.get_object(Bucket="vx-out", Key=f"{prefix}/{p}/manifest.jsonl")["Body"].read()
        except Exception:
            continue
        n += len(body.splitlines())
    return n


def reader_commits(client, prefix) -> list:
    """What the trainer ranks recorded as consumed (vx.loader(...).commit)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="vx-out", Prefix=f"{prefix}/.vx-readers/")
    return sorted(client.get_object(Bucket="vx-out", Key=o["Key"])["Body"].read() for page in pages
                  for o in page.get("Contents", []))


def wait_for(cond, what, progress, logs=(), stall=300):
    """Wait for cond(); fail only once progress() (what the processes have done so far) stayed the same
    for `stall` seconds: a loaded machine makes them slow, which is not what this test is about."""
    last, since = progress(), time.monotonic()
    while not cond():
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        assert time.monotonic() - since < stall, (f"no progress for {stall} s waiting for {what} (at {last}): " +
                                                  " | ".join(Path(f).read_text()[-1500:] for f in logs))
        time.sleep(0.2)


def test_train_while_extracting_to_s3_exactly_once_through_kills_with_bounded_storage(tmp_path, tiny_model):
    from s3_faults import free_port

    os.environ.update(CREDS)
    server, url, client = start_s3(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    n = 1000
    data = write_jsonl(tmp_path / "d.jsonl", chats(n, seed=1))
    shard_mb, retain_gb = 0.25, 0.01  # 10 MB: ~40 shards of ~0.25 MB, 20 per writer
    extract = [sys.executable, "-m", "vx", "extract", str(data), "-o", "s3://vx-out/run", "--endpoint-url", url,
               "--backend", "hf", "--dp", "2", "--layers", LAYERS, "--shard-size", str(shard_mb),
               "--retain-gb", str(retain_gb), "--json"]
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "examples/train_draft.py", "s3://vx-out/run", "--endpoint-url", url, "--follow", "--epochs", "1",
             "--steps", "1000000", "--tokens-per-batch", "400", "--shuffle-shards", "4", "--cache-gb", "0.05",
             "--checkpoint", str(tmp_path / "ckpt"), "--every", "4", "--trace", str(tmp_path / "trace"),
             "--follow-timeout", "300"]
    peak, stop = [0, 0], threading.Event()

    def watch():  # the S3 prefix's shard bytes, sampled all along
        while not stop.is_set():
            b, c = shard_objects(client, "run")
            peak[0], peak[1] = max(peak[0], b), max(peak[1], c)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ex = run_bg(extract, env, tmp_path / "extract1.log")
        tr = run_bg(train, env, tmp_path / "train1.log")
        # kill -9 the extraction (launcher and workers) once part of it is committed, then rerun it
        wait_for(lambda: committed_shards(client, "run") >= 30 or ex.poll() is not None, "30 committed shards",
                 progress=lambda: committed_shards(client, "run"), logs=[tmp_path / "extract1.log"])
        assert ex.poll() is None, (tmp_path / "extract1.log").read_text()[-2000:]
        os.killpg(ex.pid, signal.SIGKILL)
        ex.wait()
        ex = run_bg(extract, env, tmp_path / "extract2.log")
        # kill -9 trainer rank 1 mid-epoch; torchrun stops the group; restart from the checkpoints
        trace1 = tmp_path / "trace.rank1"
        steps1 = lambda: len(trace1.read_text().splitlines()) if trace1.exists() else 0  # noqa: E731
        wait_for(lambda: steps1() >= 12, "12 steps of rank 1", progress=lambda: (steps1(), committed_shards(client, "run")),
                 logs=[tmp_path / "train1.log", tmp_path / "extract2.log"])
        workers = subprocess.run(["pgrep", "-f", "examples/train_draft.py"], capture_output=True, text=True).stdout
        rank1 = [int(p) for p in workers.split()
                 if int(p) != tr.pid and "RANK=1" in open(f"/proc/{p}/environ").read().split("\0")]
        assert rank1, workers
        os.kill(rank1[0], signal.SIGKILL)
        assert tr.wait(timeout=120) != 0
        tr = run_bg(train, env, tmp_path / "train2.log")
        # the extraction ends once the trainers consumed all but --retain-gb of it: both move until then
        both = [tmp_path / "extract2.log", tmp_path / "train2.log"]
        moved = lambda: (committed_shards(client, "run"), steps1(), reader_commits(client, "run"))  # noqa: E731
        wait_for(lambda: ex.poll() is not None or tr.poll() not in (None, 0), "the extraction to end", moved, both)
        assert ex.returncode == 0, (ex.returncode, (tmp_path / "extract2.log").read_text()[-3000:],
                                    (tmp_path / "train2.log").read_text()[-3000:])
        extract_end = time.time()
        wait_for(lambda: tr.poll() is not None, "the trainers to end", moved, both)
        assert tr.wait() == 0, (tmp_path / "train2.log").read_text()[-3000:]
        largest = max(json.loads(line)["bytes"] for p in ("part-00000-of-00002", "part-00001-of-00002")
                      for line in client.get_object(Bucket="vx-out", Key=f"run/{p}/manifest.jsonl")["Body"].read()
                      .decode().splitlines())
        dropped = sum(len(client.get_object(Bucket="vx-out", Key=f"run/{p}/dropped.jsonl")["Body"].read().splitlines())
                      for p in ("part-00000-of-00002", "part-00001-of-00002"))
        resumed = json.loads((tmp_path / "extract2.log").read_text().splitlines()[-1])["resumed_samples"]
        later = vx.loader("s3://vx-out/run", 400, follow=True, endpoint_url=url, cache_dir=str(tmp_path / "c"))
        later.set_epoch(1)  # epoch 2 needs the shards --retain-gb dropped: one line that says so
        with pytest.raises(vx.errors.UsageError, match=r"epoch 1 needs \d+ shards .* deleted once every reader"):
            next(iter(later))
    finally:
        stop.set()
        for p in ("ex", "tr"):
            proc = locals().get(p)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        server.stop()
    # every (rank, step) as last recorded: steps after a checkpoint that a crash lost were redone
    final, first_step = {}, float("inf")
    for r in (0, 1):
        for line in (tmp_path / f"trace.rank{r}").read_text().splitlines():
            e = json.loads(line)
            final[(r, e["step"])] = e
            first_step = min(first_step, e["time"])
    steps = [max(s for rr, s in final if rr == r) for r in (0, 1)]
    assert steps[0] == steps[1] and len(final) == 2 * steps[0]
    trained = collections.Counter(s for e in final.values() if not e["padding"] for s in e["sample_ids"])
    assert set(trained) == {f"c{i}" for i in range(n)}, len(trained)
    assert max(trained.values()) == 1, [s for s, k in trained.items() if k > 1][:5]
    assert first_step < extract_end and 0 < resumed < n and dropped > 0
    assert peak[0] <= retain_gb * 1e9 + 2 * largest, (peak, retain_gb * 1e9)
    print(f"follow: {n} samples, {steps[0]} steps per rank, first step {extract_end - first_step:.1f} s before the "
          f"extraction ended; S3 peak {peak[0] / 1e6:.2f} MB in {peak[1]} shards (bound {retain_gb * 1e3:.0f} MB); "
          f"{dropped} shards dropped once consumed; the rerun resumed {resumed} committed samples")
