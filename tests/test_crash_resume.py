"""Kill -9 at any point of the pipeline, rerun the same command: every valid sample ends in S3
exactly once, every shard passes its checksum. Faults are injected with VX_FAULT failpoints."""

import json

import pytest

import vx
from conftest import machine_cache
from test_cli import vx_cmd
from test_s3 import CREDS, data_file, download, s3_server  # noqa: F401  (fixture)

KILL_POINTS = [
    ("after-batch", 2),        # mid-compute, between forwards
    ("mid-shard-write", 2),    # torn temp file
    ("before-rename", 2),      # temp file complete and fsynced
    ("before-manifest", 2),    # renamed, not committed
    ("after-manifest", 2),     # committed, not uploaded
    ("before-upload", 3),
    ("mid-upload", 2),         # during the transfer
    ("after-upload", 2),       # in S3, not in the S3 manifest
    ("after-s3-manifest", 1),  # in the S3 manifest, local file not deleted
    ("after-delete", 3),
]


def run(tmp_path, prefix, fault=None, cache="cache"):
    env = dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / cache))
    if fault:
        env["VX_FAULT"] = fault
    return vx_cmd("extract", str(data_file(tmp_path)), "-o", f"s3://vx-out/{prefix}", "--endpoint-url",
                  env["_URL"] if "_URL" in env else run.url, "--backend", "hf", "--shard-size", "0.2",
                  "--batch-size", "4", "--json", env=env)


def assert_exactly_once(client, tmp_path, prefix):
    copy = tmp_path / f"copy-{prefix}"
    download(client, "vx-out", prefix, copy)
    records = [json.loads(line) for line in open(copy / "manifest.jsonl")]
    ids = [sid for r in records for sid in r["sample_ids"]]
    assert sorted(ids) == sorted(f"s{i}" for i in range(24)), "lost or duplicated samples"
    verify = vx_cmd("verify", str(copy), "--samples", "24", "--json")  # every sample, redone ones included
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout
    assert len(vx.open_dataset(copy)) == 24


@pytest.mark.parametrize("point, nth", KILL_POINTS)
def test_kill_9_then_rerun_gives_every_sample_exactly_once(s3_server, tmp_path, tiny_model, point, nth):  # noqa: F811
    url, client = s3_server
    run.url = url
    killed = run(tmp_path, point, fault=f"{point}:{nth}")
    assert killed.returncode == -9, f"failpoint {point} not reached: {killed.stderr[-1500:]}"
    again = run(tmp_path, point)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_exactly_once(client, tmp_path, point)
    [staged] = (tmp_path / "cache" / "staging").glob(f"*/vx-out/{point}")
    assert not list(staged.glob("shard-*")) and not list(staged.glob(".shard-*"))


def test_disk_full_while_writing_a_shard_stops_cleanly_and_resumes(s3_server, tmp_path, tiny_model):  # noqa: F811
    url, client = s3_server
    run.url = url
    full = run(tmp_path, "enospc", fault="enospc:3")
    assert full.returncode == 1 and "No space left on device" in full.stderr and "rerun" in full.stderr
    assert "Traceback" not in full.stderr
    again = run(tmp_path, "enospc")
    assert again.returncode == 0, again.stderr[-2000:]
    assert_exactly_once(client, tmp_path, "enospc")
