"""Crash anywhere, lose nothing: the fault campaign (tests/fault_campaign.py) on the hf backend,
every failpoint of vx.faults.POINTS that a one-engine extraction passes (shard bytes, fsync,
rename, manifest append and its repair, each S3 upload step and multipart part, the S3 manifest,
--retain-gb deletion) fired once, by kill, I/O error, full disk or stall, each followed by a
rerun; then the trials that once found a violation. After each: every sample exactly once, every
committed shard's CRC64-NVME, every row against a clean run, S3 listing = manifests with no open
multipart upload, no temp file, no orphan process, no traceback, follow readers saw every sample
once. Then SIGKILL, SIGTERM and SIGINT from outside, to the driver and to its whole process group
(a scheduler's kill, `timeout`, Ctrl-C): it ends within 60 s with its documented exit code, and the
rerun completes the output. --dp 2, signals to an engine or a partition worker, and the other
modes (vLLM, vx regenerate, the one-pass mode) run as a command: `python tests/fault_campaign.py
--trials 200`."""

from __future__ import annotations

import sys

from conftest import ROOT


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
    # a partition worker stopped under --retain-gb: the launcher waited for the other, whose writer
    # waited at its bound for readers waiting for the stopped partition (a hang); the others are
    # now stopped with it. Two engines: test_follow's failed-partition test is its regression in CI
    {"mode": "extract-hf", "sink": "local", "dp": 2, "follow": True, "retain": True, "index": 36, "seed": 49,
     "fault": {"kind": "signal", "target": "worker", "sig": "TERM", "at": 0.1835671333386726}},
    # SIGTERM to the one-pass driver as its capture engine started came back as the capture's
    # normal end (vLLM's engine start-up swallows KeyboardInterrupt: vx.engine.lifetime.liveness.start_watched):
    # the driver released the held regeneration and waited on it (no exit in 60 s). Two engines,
    # and a moment a random draw hits only sometimes: test_one_pass's first run signals at that
    # moment, its regression in CI
    {"mode": "one-pass", "sink": "local", "dp": 1, "follow": False, "retain": False, "index": 119, "seed": 50,
     "fault": {"kind": "signal", "target": "driver", "sig": "TERM", "at": 0.24199639575850596}},
    # `vx regenerate --dp 2` killed after the merge's fsync: in the rerun, the partition with nothing
    # left merged the parts while the other's worker started, which found its part locked and failed.
    # The launcher now merges once all are done. Two engines: test_regenerate's merge-lock test is
    # its regression in CI
    {"mode": "regenerate", "sink": "local", "dp": 2, "follow": False, "retain": False, "index": 24, "seed": 52,
     "fault": {"kind": "point", "name": "after-merge", "nth": 1, "action": "kill"}},
    # a signal while vLLM started the one-pass capture engine: vLLM caught the KeyboardInterrupt in its
    # handshake and waited on for the engine's ready message, and the driver acted on the stop only
    # once the start was over (> 60 s on a loaded machine). Two engines: test_engine_lifetime's
    # Ctrl-C-during-the-start test is their regression in CI
    {"mode": "one-pass", "sink": "local", "dp": 1, "follow": False, "retain": False, "index": 14, "seed": 54,
     "fault": {"kind": "signal", "target": "driver", "sig": "INT", "at": 0.2311166396343233}},
    {"mode": "one-pass", "sink": "local", "dp": 1, "follow": False, "retain": False, "index": 16, "seed": 54,
     "fault": {"kind": "signal", "target": "group", "sig": "TERM", "at": 0.35802671176744894}},
    # SIGINT to one partition worker of a one-pass --dp 2 run to S3: the rerun's launcher compacted
    # S3's text segments into its merged file alone, which lacked what the parts held, and deleted
    # the rest: S3 then held states of 12 conversations without their text. The restore now puts
    # every committed conversation's text in the merged file before the compaction. Two engines
    # a slot: it runs in the long campaign (python tests/fault_campaign.py)
    {"mode": "one-pass", "sink": "s3", "dp": 2, "follow": False, "retain": False, "index": 73, "seed": 60,
     "fault": {"kind": "signal", "target": "worker", "sig": "INT", "at": 0.2883054344964151}},
    # SIGTERM to the vLLM engine core early in a run: its worker died, its core lingered, and vLLM's
    # process manager force-killed it 5 s later, logging that after vx's one-line error (exit 3 was
    # right, the last line was not). vx now ends what is left of a dead engine itself, before vLLM's
    # client cleans up (vx.engine.vllm_engine.end_dead_engine). vLLM engine: it runs in the long campaign (python tests/fault_campaign.py);
    # test_engine_lifetime's SIGTERM-to-the-core step is its CI counterpart
    {"mode": "extract-vllm", "sink": "local", "dp": 1, "follow": False, "retain": False, "index": 35, "seed": 61,
     "fault": {"kind": "signal", "target": "engine", "sig": "TERM", "at": 0.2758604849269048}},
    # SIGINT to the one-pass driver's group (Ctrl-C in a terminal) as its capture engine started: the
    # engine's core ended its start on the signal, and vLLM, its own wait for the core broken by the
    # stop, waited on a socket nothing answered (no exit in 60 s). The watch now leaves on a core that
    # ended its start on a stop. Two engines: test_engine_lifetime's Ctrl-C-during-the-start test,
    # to the group, is its regression in CI
    {"mode": "one-pass", "sink": "local", "dp": 1, "follow": False, "retain": False, "index": 25, "seed": 65,
     "fault": {"kind": "signal", "target": "group", "sig": "INT", "at": 0.4930195175241662}},
]


# reached only where the run before left work of that kind: not a second fault's place
LATE = {"after-delete"}


def paired(trials: list[dict]) -> list[dict]:
    """Two failpoints per trial where the first one's configuration passes the second: the second
    fires during the recovery run of the first (a crash while recovering from a crash), then the
    clean rerun and the checks. Half the runs for the same coverage."""
    out, pending = [], [t for t in trials]
    while pending:
        a = pending.pop(0)
        if "then" not in a and a["fault"]["action"] == "kill":  # a stall or an error may leave no work to fault
            b = next((b for b in pending if "then" not in b and b["fault"]["name"] in campaign.points_for(a)
                      and b["fault"]["name"] not in LATE), None)
            if b is not None:
                pending.remove(b)
                a = dict(a, then=b["fault"])
        out.append(a)
    return out


def inside(t: dict) -> dict:
    """A signal trial whose moment (drawn in 0.1-0.7 of a clean run) lands before the run's end on a
    machine faster than the one that timed the clean run: at most 0.4 of it."""
    return dict(t, fault=dict(t["fault"], at=0.1 + (t["fault"]["at"] - 0.1) / 2))


def test_a_fault_at_every_durable_step_then_a_rerun_loses_nothing(tmp_path, tiny_model):
    """CI's share (time): every failpoint one hf engine passes, two to a trial, the outside signals
    to the driver and its process group, then the regression trials that need one engine. --dp 2
    and the vLLM modes run in the long campaign (python tests/fault_campaign.py)."""
    modes = ["extract-hf"]
    cover = campaign.coverage(modes)
    points = [i for i, item in enumerate(cover) if item[0] == "point" and item[1] != "before-plan-publish"]
    signals = [i for i, item in enumerate(cover) if item[0] == "signal" and item[1] in ("driver", "group")]
    trials = paired([campaign.draw(SEED, i, modes) for i in points]) + [inside(campaign.draw(SEED, i, modes))
                                                                        for i in signals]
    regressions = [t for t in REGRESSIONS if t["dp"] == 1 and t["mode"] == "extract-hf"]
    lines = []
    t = campaign.run_campaign(0, SEED, tmp_path, modes, only=[], extra=trials + regressions, log=lines.append)
    for attempt in range(3):  # a run faster than the clean run that timed it (that one on a loaded machine)
        missed = [x for x in trials if x["fault"]["kind"] == "signal"  # ends before its moment: sooner, again
                  and f"{x['fault']['sig']}->{x['fault']['target']}" not in t["signals_sent"]]
        if not missed:
            break
        again = campaign.run_campaign(0, SEED, tmp_path / f"again{attempt}", modes, only=[], log=lines.append,
                                      extra=[dict(x, fault=dict(x["fault"], at=x["fault"]["at"] / 2)) for x in missed])
        t["violations"] += again["violations"]
        t["invariants_checked"] += again["invariants_checked"]
        t["signals_sent"] = dict(t["signals_sent"], **again["signals_sent"])
    print("\n".join(lines))
    assert t["trials"] == len(trials) + len(regressions) >= 20
    assert not t["violations"], t["violations"]
    want = {cover[i][1] for i in points}
    assert want <= set(t["failpoints_fired"]) and want <= set(faults.POINTS), want - set(t["failpoints_fired"])
    assert set(t["signals_sent"]) == {f"{s}->{tg}" for tg in ("driver", "group") for s in ("KILL", "TERM", "INT")}
    assert t["invariants_checked"] > 10 * t["trials"]


def test_the_bench_campaign_reaches_every_failpoint_and_redraws_a_trial_from_its_seed():
    """The bench's 200 trials (every mode) cover every failpoint vx has and every outside signal
    to each target first; a trial is the same trial when drawn again from its printed seed."""
    modes = campaign.MODES
    cover = campaign.coverage(modes)
    assert {item[1] for item in cover if item[0] == "point"} == set(faults.POINTS)
    assert {(item[1], item[2]) for item in cover if item[0] == "signal"} == {
        (tg, sig) for tg in ("driver", "group", "engine", "worker") for sig in campaign.SIGNALS}
    for i in (0, len(cover) - 1, len(cover), 199):
        assert campaign.draw(45, i, modes) == campaign.draw(45, i, modes)
    assert campaign.draw(45, 150, modes) != campaign.draw(46, 150, modes)
