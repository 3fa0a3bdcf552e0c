"""Crash anywhere, lose nothing: the fault campaign (bench/fault_campaign.py) on the hf backend,
every failpoint of vx.faults.POINTS that an extraction passes (shard bytes, fsync, rename,
manifest append and its repair, each S3 upload step and multipart part, the S3 manifest, the
partition plan, --retain-gb deletion) fired once, by kill, I/O error, full disk or stall, and
every outside signal (SIGKILL, SIGTERM, SIGINT to the driver, its process group, a partition
worker), each followed by a rerun; then the trials that once found a violation. After each:
every sample exactly once, every committed shard's CRC64-NVME, every row against a clean run,
S3 listing = manifests with no open multipart upload, no temp file, no orphan process, no
traceback, a signalled run ends within 60 s with its documented code, follow readers saw every
sample once. The campaign's other modes (vLLM, vx regenerate, the one-pass mode) run in the
bench: `python bench/fault_campaign.py --trials 200`."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import fault_campaign as campaign  # noqa: E402

from vx import faults  # noqa: E402

SEED = 29

# Trials that found a violation, as the campaign drew them, each fixed since
REGRESSIONS = [
    # a kill before CompleteMultipartUpload left the upload open under the prefix (parts S3 bills
    # and never lists): the uploader now aborts its open uploads at start
    {"mode": "extract-hf", "sink": "s3-multipart", "dp": 1, "follow": True, "retain": False, "index": 0, "seed": 2,
     "fault": {"kind": "point", "name": "before-multipart-complete", "nth": 1, "action": "kill"}},
    # a kill between listing consumed shards as dropped and deleting them: the rerun counted the
    # leftovers against --retain-gb forever and waited for room no reader could free (a hang)
    {"mode": "extract-hf", "sink": "local", "dp": 1, "follow": True, "retain": True, "index": 4, "seed": 2,
     "fault": {"kind": "point", "name": "after-retain-delete", "nth": 1, "action": "kill"}},
    # a full disk outside the shard writer (after a batch) printed a traceback instead of one line
    {"mode": "extract-hf", "sink": "s3", "dp": 1, "follow": False, "retain": False, "index": 12, "seed": 2,
     "fault": {"kind": "point", "name": "after-batch", "nth": 1, "action": "enospc"},
     "then": {"kind": "point", "name": "after-s3-manifest", "nth": 3, "action": "kill"}},
    # an I/O error before the partition plan's rename left its temp file behind for good: removed
    # on error now, and a killed maker's (dead pid on this host) by the next one
    {"mode": "extract-hf", "sink": "s3", "dp": 2, "follow": True, "retain": True, "index": 16, "seed": 29,
     "fault": {"kind": "point", "name": "before-plan-publish", "nth": 1, "action": "eio"}},
    # a failed --retain-gb deletion ended the retainer thread while the writer waited for the room
    # it would have freed: a hang; the writer now stops with one line on the retainer's marker
    {"mode": "extract-hf", "sink": "local", "dp": 1, "follow": True, "retain": True, "index": 82, "seed": 41,
     "fault": {"kind": "point", "name": "after-retain-delete", "nth": 1, "action": "enospc"},
     "then": {"kind": "point", "name": "mid-shard-write", "nth": 2, "action": "kill"}},
]


def test_a_fault_at_every_durable_step_and_every_signal_then_a_rerun_loses_nothing(tmp_path, tiny_model):
    modes = ["extract-hf"]
    cover = campaign.coverage(modes)
    lines = []
    t = campaign.run_campaign(len(cover), SEED, tmp_path, modes, extra=REGRESSIONS, log=lines.append)
    print("\n".join(lines))
    assert t["trials"] == len(cover) + len(REGRESSIONS) >= 20
    assert not t["violations"], t["violations"]
    reached = {p for c in campaign.configs(modes) for p in campaign.points_for(c)} | {"repair-manifest"}
    assert set(t["failpoints_fired"]) == reached, reached ^ set(t["failpoints_fired"])
    assert reached <= set(faults.POINTS)
    assert t["max_exit_after_signal_s"] is not None and t["max_exit_after_signal_s"] < campaign.SIGNAL_EXIT_S
    assert t["invariants_checked"] > 10 * t["trials"]
