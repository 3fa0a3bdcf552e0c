"""Named failpoints for crash and fault tests: `VX_FAULT=name[:n[:action]]` acts at the n-th pass
(default 1) of point `name` in a process.

Actions: `kill` (default: SIGKILL of the process itself, what a dead machine or the OOM killer
does), `eio` / `enospc` (raise OSError EIO / ENOSPC, a failing or full disk), `stall` (sleep
VX_FAULT_STALL_S seconds, default 3600: a hung mount or a throttled endpoint; with
`VX_FAULT_STALL_UNTIL=FILE`, until FILE exists, within that bound: a writer paused by a network
partition or a hung host, woken when a test says so). Every point is in
POINTS with the durable step it stands before (tests/test_architecture.py holds POINTS and the
code's calls equal). `engine-step` and `engine-sample` are in the vLLM engine core: they act on
the engine under a live driver.

`VX_FAULT=corrupt-layer:j` is not a failpoint: the capture path shifts layer position j of every
captured chunk by one token (the rows of token t hold token t-1's states), the silent kind of
wrong that `vx selftest` and `vx extract --verify` must catch.

Scoping: `VX_FAULT_PARTITION=i` limits the fault to the worker of partition i, `VX_FAULT_HOST=NAME`
to processes on the host of that name; `VX_FAULT_ONCE=FILE`
fires it only if FILE does not exist yet (and creates it), so a retried worker runs clean;
`VX_FAULT_TRACE=FILE` appends each point's name the first time a process passes it (the fault
campaign's tally of what it reached). Unset in production: one string comparison per point.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time

POINTS = {
    # the shard writer (vx/store/format.py, writer.py)
    "mid-shard-write": "part of a shard's bytes in its temp file",
    "before-shard-fsync": "a shard's bytes written, not fsynced",
    "before-rename": "the temp file complete and fsynced, not renamed",
    "before-manifest": "the shard renamed, not in the manifest",
    "mid-manifest": "half of the shard's manifest line appended (a torn line)",
    "after-manifest": "the shard committed",
    "repair-manifest": "a torn manifest line being cut at start",
    # staging for S3 (vx/store/uploader.py)
    "before-upload": "a committed shard about to be uploaded",
    "mid-upload": "bytes of a shard in transfer",
    "upload-part": "a multipart upload's part about to be read and sent",
    "before-multipart-complete": "every part uploaded, the multipart upload not completed",
    "after-upload": "the shard in S3, not in the S3 manifest",
    "before-s3-manifest": "the S3 manifest about to be replaced",
    "after-s3-manifest": "the S3 manifest published, local copies not deleted",
    "after-delete": "a local copy of an uploaded shard deleted",
    # --retain-gb (vx/store/retention.py)
    "before-retain-delete": "consumed shards listed as dropped, not deleted",
    "after-retain-delete": "a consumed shard deleted",
    # --data-parallel-size (vx/launch/plan.py)
    "before-plan-publish": "the partition plan (or its token weights) written, not renamed into place",
    # compute (vx/jobs/extract.py, vx/engine/, vx/engine/generator.py)
    "after-batch": "an HF batch computed and handed to the writer",
    "after-step": "an engine step's outputs taken by the driver",
    "engine-step": "the engine core's n-th step (warm-up included)",
    "engine-sample": "a sample whose kept rows the scheduled step completes, in the engine core",
    # vx regenerate and the one-pass mode (vx/store/text_output.py)
    "after-chunk": "a chunk of regenerated conversations committed",
    "before-chunk-fsync": "regenerated conversations written, not fsynced",
    "before-committed-mark": "regenerated conversations fsynced, their committed size not recorded",
    "after-merge": "partitions' regenerated conversations merged",
    # the one-pass mode's text in S3 (vx/jobs/regenerated_text.py)
    "before-text-segment": "regenerated conversations about to go to S3 as a segment",
    "after-text-compact": "all regenerated text in S3 as one segment, the older ones not deleted",
}

_spec = os.environ.get("VX_FAULT", "")
_NAME, _, _rest = _spec.partition(":")
_N, _, _ACTION = _rest.partition(":")
_TARGET = int(_N or 1) if _NAME else 0
_ACTION = _ACTION or "kill"
_TRACE = os.environ.get("VX_FAULT_TRACE")
_count = 0
_seen: set[str] = set()


def point(name: str) -> None:
    global _count
    if _TRACE and name not in _seen:
        _seen.add(name)
        with open(_TRACE, "a") as f:
            f.write(f"{name}\n")
    if name != _NAME:
        return
    only = os.environ.get("VX_FAULT_PARTITION")
    if only is not None and os.environ.get("VX_PARTITION") != only:
        return
    host = os.environ.get("VX_FAULT_HOST")
    if host is not None and socket.gethostname() != host:
        return
    _count += 1
    if _count != _TARGET:
        return
    once = os.environ.get("VX_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    if _TRACE:
        with open(_TRACE, "a") as f:
            f.write(f"fired {name}:{_count}:{_ACTION}\n")
    if _ACTION == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    if _ACTION == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {name})")
    if _ACTION == "stall":
        until, end = os.environ.get("VX_FAULT_STALL_UNTIL"), time.monotonic() + float(os.environ.get("VX_FAULT_STALL_S", "3600"))
        while time.monotonic() < end and not (until and os.path.exists(until)):
            time.sleep(0.1 if until else max(0.0, end - time.monotonic()))
        return
    os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """Whether VX_FAULT names this point: lets a caller skip work that exists only for it."""
    return name == _NAME or bool(_TRACE)


def corrupt_rows(rows) -> None:
    """The corrupt-layer failpoint: rows [T, L, H] of a captured chunk, changed in place."""
    if _NAME != "corrupt-layer" or rows.shape[0] < 2:
        return
    j = int(_N or 0)
    if 0 <= j < rows.shape[1]:
        rows[:, j] = rows[:, j].roll(1, dims=0)
