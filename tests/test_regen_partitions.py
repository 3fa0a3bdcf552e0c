"""`vx regenerate` over partitions: --dp N, --num-partitions/--partition-index (SLURM-style, in any
order) and --ray each give one OUTPUT holding every conversation exactly once, the same greedy
turns as a single engine; a partition worker killed with SIGKILL fails the run, and the rerun
finishes it without regenerating what was committed."""

import json

import pytest

from conftest import write_jsonl
from test_cli import vx_cmd

ROWS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about the number {i}." + " Why?" * (i % 5)},
                                     {"role": "assistant", "content": "old answer"}]
         + ([{"role": "user", "content": "And after that?"}, {"role": "assistant", "content": "old"}] if i % 3 == 0
            else [])} for i in range(12)]
ARGS = ("--max-tokens", "6", "--json")


def read(path) -> dict[str, dict]:
    lines = open(path).read().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len({r["id"] for r in recs}) == len(recs), "an id written twice"
    return {r["id"]: r for r in recs}


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("regen-single")
    data = write_jsonl(d / "d.jsonl", ROWS)
    r = vx_cmd("regenerate", str(data), "-o", str(d / "r.jsonl"), *ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    return data, read(d / "r.jsonl")


def assert_same(out: dict, ref: dict) -> None:
    assert sorted(out) == sorted(ref) == sorted(r["id"] for r in ROWS)
    for sid, rec in ref.items():  # greedy: the engine a conversation ran on changes nothing
        assert out[sid]["messages"] == rec["messages"], sid
        assert [t["index"] for t in out[sid]["vx_turns"]] == [t["index"] for t in rec["vx_turns"]]


def test_partition_index_in_any_order_merges_when_the_last_one_finishes(single, tmp_path):
    data, ref = single
    out = tmp_path / "r.jsonl"
    part = ("--num-partitions", "2", "--partition-index")
    r1 = vx_cmd("regenerate", str(data), "-o", str(out), *part, "1", *ARGS)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert not out.exists() and json.loads(r1.stdout)["merged"] is False  # partition 0 not done yet
    r0 = vx_cmd("regenerate", str(data), "-o", str(out), *part, "0", *ARGS)
    assert r0.returncode == 0, r0.stderr[-3000:]
    assert json.loads(r0.stdout)["merged"] is True
    assert json.loads(r0.stdout)["conversations"] + json.loads(r1.stdout)["conversations"] == 12
    assert_same(read(out), ref)
    again = vx_cmd("regenerate", str(data), "-o", str(out), *part, "1", *ARGS)  # a retried array task
    assert again.returncode == 0 and json.loads(again.stdout)["conversations"] == 0
    assert_same(read(out), ref)


def test_data_parallel_with_a_killed_partition_fails_then_its_rerun_as_ray_tasks_equals_a_single_engine(
        single, tmp_path):
    """--dp 2: partition 1 is killed with SIGKILL after 2 committed chunks, so the run fails; the
    rerun, as Ray tasks this time (one launcher: a partition resumes wherever it runs), regenerates
    only the rest and merges one output equal to a single engine's. Paths are relative: a task
    runs elsewhere."""
    ray = pytest.importorskip("ray")
    data, ref = single
    out = tmp_path / "r.jsonl"
    (tmp_path / "d.jsonl").write_bytes(data.read_bytes())
    args = ("regenerate", "d.jsonl", "-o", "r.jsonl", "--commit-every", "1", *ARGS)
    killed = vx_cmd(*args, "--dp", "2", env={"VX_FAULT": "after-chunk:2", "VX_FAULT_PARTITION": "1"}, cwd=tmp_path)
    assert killed.returncode == 1 and "1 of 2 partitions failed: partition 1 (exit -9" in killed.stderr, killed.stderr
    part1 = tmp_path / "r.jsonl.parts" / "part-00001-of-00002.jsonl"
    committed = read(part1)
    assert len(committed) == 2 and not out.exists()  # partition 0 finished; nothing merged without partition 1
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        r = vx_cmd(*args, "--ray", "--ray-address", address, cwd=tmp_path)
    finally:
        ray.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["conversations"] + s["skipped"] == 12 and s["skipped"] >= 2  # partition 0 and the 2 committed
    assert len(s["partitions"]) == 2 and all(p["node"] for p in s["partitions"])
    assert_same(read(out), ref)
    assert not list((tmp_path / "r.jsonl.parts").glob("*.jsonl"))  # merged parts are gone


def test_a_merge_beside_a_part_still_written_keeps_the_bad_records_it_took(tmp_path):
    """A merge while partition 1 is still written (its rerun holds the part's lock) takes partition
    0's conversations and bad records, and leaves partition 1 for its own merge; that one adds
    partition 1's without losing partition 0's: every bad record once in OUTPUT.errors.jsonl,
    however many merges ran."""
    from vx.store.text_output import merge_parts, part_path, sidecar
    from vx.store.lock import try_lock

    out = tmp_path / "r.jsonl"
    for i in (0, 1):
        part = part_path(out, i, 2)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps({"id": f"c{i}", "messages": []}) + "\n")
        sidecar(part, ".errors.jsonl").write_text(json.dumps({"line": 10 + i, "reason": "no 'messages'"}) + "\n")
    writer, _ = try_lock(sidecar(part_path(out, 1, 2), ".lock"))
    assert merge_parts(out, 2)["complete"] is False
    writer.close()
    assert merge_parts(out, 2)["complete"] is True
    assert merge_parts(out, 2)["complete"] is True  # merged before: nothing changes
    assert sorted(read(out)) == ["c0", "c1"]
    lines = sidecar(out, ".errors.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["line"] for x in lines) == [10, 11]
