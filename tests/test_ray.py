"""--ray on real local Ray clusters (two nodes of one CPU each, and one node started by ray.init
with 2 CPUs as resources) writing to a real S3 endpoint: the partitions run as Ray tasks, a
partition task killed once is retried by Ray and resumes from its manifest, and S3 holds the
single-process dataset, exactly once."""

import json
import sys
import time
import uuid

import pytest

import vx
from conftest import ROOT, write_jsonl
from test_cli import vx_cmd
from test_s3 import CREDS, download, s3_server  # noqa: F401  (fixture)
from test_scale_out import CHAT, assert_same_dataset
from test_follow import LAYERS, chats

import procfs  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(tiny_model):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def two_nodes(tiny_model):
    """A Ray cluster of two nodes on this machine: a head and a worker node, each its own raylet,
    object store and worker processes, started before (and so without) the driver's settings, one
    CPU each: the two partitions' tasks cannot share a node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False,
                                                                object_store_memory=128 << 20))
    cluster.add_node(num_cpus=1, object_store_memory=128 << 20)
    yield cluster.address
    cluster.shutdown()


def test_partitions_run_as_ray_tasks_on_two_nodes_and_a_killed_one_is_retried_exactly_once(two_nodes, s3_server,  # noqa: F811
                                                                                          tmp_path):
    """The plan and the driver's settings (here VX_FAULT*, which no node was started with) reach the
    task on the node that is not the driver's; the killed partition resumes from S3's manifest."""
    ray_cluster = two_nodes
    url, client = s3_server
    single, marker = tmp_path / "single", tmp_path / "killed-once"
    env = dict(CREDS, VX_FAULT="after-batch:2", VX_FAULT_PARTITION="1", VX_FAULT_ONCE=str(marker))
    r = vx_cmd("extract", CHAT, "-o", "s3://vx-out/ray", "--endpoint-url", url, "--backend", "hf",
               "--batch-size", "4", "--shard-size", "5", "--ray", "--ray-address", ray_cluster,
               "--num-partitions", "2", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists(), "the fault never fired"
    s = json.loads(r.stdout)  # stdout holds the summary only; Ray's retry notice went to stderr
    assert [p["attempts"] for p in s["partitions"]] == [1, 2]
    first = [p["attempt_nodes"][0] for p in s["partitions"]]
    assert len(set(first)) == 2 and all(first), s["partitions"]  # began one on each node
    assert s["partitions"][1]["attempt_nodes"][-1] == s["partitions"][1]["node_id"]
    assert s["samples"] == 64 and s["tokens"] == 22544
    assert vx_cmd("extract", CHAT, "-o", str(single), "--backend", "hf").returncode == 0
    download(client, "vx-out", "ray", tmp_path / "copy")
    assert_same_dataset(vx.open_dataset(tmp_path / "copy"), vx.open_dataset(single), states=False)
    verify = vx_cmd("verify", "s3://vx-out/ray", "--endpoint-url", url, "--samples", "2", "--json", env=CREDS)
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout


def test_the_one_pass_mode_on_ray_keeps_each_conversations_text_in_s3_with_its_states(ray_cluster, s3_server,  # noqa: F811
                                                                                      tmp_path, tokenizer):
    """`vx extract --regenerate --ray`: each partition's regeneration and capture as one Ray task,
    the text to S3 before its states; one task killed once mid-capture and retried by Ray. The
    driver builds prefix/regenerated.jsonl from S3's text: every conversation once, each one's
    stored ids its text's (the tokenizer's own rendering)."""
    url, client = s3_server
    marker = tmp_path / "killed-once"
    env = dict(CREDS, VX_FAULT="after-batch:2", VX_FAULT_PARTITION="1", VX_FAULT_ONCE=str(marker))
    r = vx_cmd("extract", CHAT, "-o", "s3://vx-out/ray-one", "--endpoint-url", url, "--regenerate", "--backend", "hf",
               "--max-tokens", "8", "--batch-size", "4", "--shard-size", "0.05", "--ray", "--ray-address", ray_cluster,
               "--num-partitions", "2", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists(), "the fault never fired"
    s = json.loads(r.stdout)
    assert [p["attempts"] for p in s["partitions"]] == [1, 2]
    assert s["regenerated"]["output"] == "s3://vx-out/ray-one/regenerated.jsonl"
    download(client, "vx-out", "ray-one", tmp_path / "copy")
    records = [json.loads(line) for line in open(CHAT) if line.strip()]
    want = sorted(r["id"] for r in records if "messages" in r or "conversations" in r)
    convs = [json.loads(line) for line in (tmp_path / "copy" / "regenerated.jsonl").read_text().splitlines() if line]
    assert sorted(c["id"] for c in convs) == want
    ds = vx.open_dataset(tmp_path / "copy")
    assert sorted(ds.ids) == want
    for c in convs:
        rendered = tokenizer.apply_chat_template(c["messages"], tokenize=False)
        assert ds[c["id"]]["input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_a_partition_out_of_retries_under_a_retain_bound_cancels_the_others_instead_of_waiting_for_them(
        ray_cluster, tmp_path):
    """As with --dp (test_follow): under --retain-gb the other partition's writer waits at its bound
    for readers, which wait for the failed partition's next shard. The launcher cancels the other
    task once the failed one's retries are spent; its worker ends as on Ctrl-C, committed shards
    kept, and nothing of the run is left running."""
    data = write_jsonl(tmp_path / "d.jsonl", chats(120))
    tag = f"VX_TEST_RUN={uuid.uuid4().hex}"  # forwarded to the tasks' workers (VX_*), inherited by their engines
    env = {"VX_FAULT": "after-manifest:1", "VX_FAULT_PARTITION": "0", tag.split("=")[0]: tag.split("=")[1]}
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf", "--ray", "--ray-address",
               ray_cluster, "--num-partitions", "2", "--max-retries", "0", "--layers", LAYERS, "--shard-size", "0.03",
               "--retain-gb", "0.0003", env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and line.startswith("vx: error: 2 of 2 partitions failed"), r.stderr[-3000:]
    assert "partition 1 (stopped: under --retain-gb" in line, line
    t0 = time.monotonic()
    while procfs.tagged(tag.encode()):  # the stopped worker is reaped before its task ends; allow the kernel a moment
        assert time.monotonic() - t0 < 30, f"left running: {procfs.tagged(tag.encode())}"
        time.sleep(0.2)
    v = vx_cmd("verify", str(tmp_path / "out"), "--samples", "0")  # every committed shard passes its checksum
    assert v.returncode == 0, v.stdout + v.stderr[-2000:]


def test_no_ray_cluster_at_the_address_is_one_clear_line(tmp_path, tiny_model):
    r = vx_cmd("extract", CHAT, "-o", str(tmp_path / "o"), "--backend", "hf", "--ray", "--ray-address",
               "127.0.0.1:1", cwd=ROOT)
    assert r.returncode == 2 and "no Ray cluster at '127.0.0.1:1'" in r.stderr and "Traceback" not in r.stderr
