"""The uploader: committed shards go to S3 while compute goes on, then leave the local disk.

The shard writer commits shards locally (manifest line = commit). The uploader, a thread in the
driver process, tails the local manifest and for each committed shard: multipart upload through
awscrt's S3 client in C threads, off the driver's GIL (vx/store/crt_s3.py; boto3's transfer
manager with VX_S3_CLIENT=boto3), S3 checking the full-object CRC64-NVME on receipt; verify size
and that checksum by a HEAD; record it in the S3 manifest (flushed every few seconds and at the end),
and only after that flush delete the local file (unless --keep-local). The S3 prefix then holds
the layout of a local output directory: shards, manifest.jsonl, errors.jsonl, vx.json.

One writer a prefix: the uploader writes only through its Fence (vx/store/fence.py). The S3
manifest is a compare-and-swap on the ETag this writer last wrote, every other put is preceded by
a check of it, and a writer that lost the prefix to a newer one stops (OwnershipLost), withdrawing
the uploads the owner's manifest does not list.

Backpressure: the writer will not start a shard while local shards would exceed --max-local-gb;
it waits for the uploader to free space, so nothing is dropped. Retries with backoff for 5xx and
throttling come from the CRT's (or botocore's) standard retry mode; `upload_retries` counts the
botocore client's (the CRT does not report its own).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

from vx import faults
from vx.errors import VxError
from vx.store import checksum, crt_s3
from vx.store.s3_client import S3Target, make_client
from vx.store.fence import Fence, OwnershipLost
from vx.store.format import ERRORS, MANIFEST, RUN_META, read_manifest

MANIFEST_FLUSH_S = 5.0


UPLOAD_FAILED = ".vx-upload-failed"  # written by the uploader; a waiting writer stops on it
RETAIN_FAILED = ".vx-retain-failed"  # written by the --retain-gb retainer (vx/store/retention.py): the same


def local_shard_bytes(out: Path) -> int:
    total = 0
    for f in itertools.chain(out.glob("shard-*.safetensors*"), out.glob(".shard-*.tmp")):
        try:
            total += f.stat().st_size
        except FileNotFoundError:  # deleted by the uploader while we looked
            pass
    return total


def wait_for_room(out: Path, budget: int, nbytes: int, poll: float = 0.1) -> int:
    """Block until local shards + nbytes fit the budget; returns the bytes in use when it went on."""
    while True:
        used = local_shard_bytes(out)
        if used + nbytes <= budget or used == 0:
            return used
        if (out / UPLOAD_FAILED).exists():
            raise VxError(f"upload failed: {(out / UPLOAD_FAILED).read_text().strip()}")
        if (out / RETAIN_FAILED).exists():  # nothing will free room: stop instead of waiting for ever
            raise VxError(f"--retain-gb could not delete consumed shards: {(out / RETAIN_FAILED).read_text().strip()}; "
                          "committed samples are kept, rerun the same command to continue")
        time.sleep(poll)


class Uploader:
    """Tails out/manifest.jsonl and mirrors committed shards to S3 (a thread in the driver)."""

    def __init__(self, out: Path, target: S3Target, endpoint_url: str | None, keep_local: bool = False,
                 max_local_bytes: int | None = None, part_mb: int | None = None, concurrency: int = 8,
                 before_publish=None, fence: Fence | None = None):
        from boto3.s3.transfer import TransferConfig

        part_mb = part_mb or int(os.environ.get("VX_S3_PART_MB", "64"))  # S3's least is 5 (MiB)

        self.out, self.target, self.keep_local = Path(out), target, keep_local
        self.max_local_bytes = max_local_bytes
        # called before an S3 manifest with new shards is published: what must be in S3 before
        # those states are (the one-pass mode's regenerated text, vx/jobs/regenerated_text.py)
        self.before_publish = before_publish
        self.client = make_client(endpoint_url)
        self.transfer = TransferConfig(multipart_threshold=part_mb << 20, multipart_chunksize=part_mb << 20,
                                       max_concurrency=concurrency)
        self.crt = crt_s3.CrtS3(self.client, part_mb << 20, concurrency) if crt_s3.wanted() else None
        # this writer's hold on the prefix: every write below goes through it (vx/store/fence.py)
        self.fence = fence if fence is not None else Fence.take(self.client, target)
        self.uploaded: list[dict] = list(self.fence.records)
        self._listed = self._announced = len(self.uploaded)  # shards in the S3 manifest, and before_publish was called for
        self._done = {r["shard"] for r in self.uploaded}
        self._sent: set[str] = set()  # shard names this writer began to upload (withdrawn if it loses)
        if not keep_local:  # a crash between the S3 manifest flush and the local delete left these
            for name in self._done:
                (self.out / name).unlink(missing_ok=True)
        # what writers before this one left: open multipart uploads, shards no manifest lists
        self.fence.sweep(keep=self._done | {r["shard"] for r in read_manifest(self.out)})
        self._to_delete: list[str] = []
        self._offset = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.bytes = 0
        self.seconds = 0.0
        self.committed_bytes = 0  # seen in the local manifest this run
        self.retries = 0          # S3 requests botocore retried (RetryAttempts of each response)
        self.client.meta.events.register("after-call.s3", self._count_retries)
        self.client.meta.events.register("before-call.s3.UploadPart", _upload_part_point)
        self.client.meta.events.register("before-call.s3.CompleteMultipartUpload", _complete_point)
        self._last_flush = time.monotonic()
        self._published: dict[str, tuple] = {}  # vx.json, errors.jsonl: their stat when last put
        (self.out / UPLOAD_FAILED).unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._run, name="vx-uploader", daemon=True)

    def start(self) -> "Uploader":
        self._thread.start()
        return self

    def _new_records(self) -> list[dict]:
        path = self.out / MANIFEST
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.committed_bytes += sum(r["bytes"] for r in records if r["shard"] not in self._done)
        return records

    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                for rec in self._new_records():
                    if rec["shard"] not in self._done:
                        self._upload(rec)
                if stopping or time.monotonic() - self._last_flush > MANIFEST_FLUSH_S or self._disk_tight():
                    self._flush()
                if stopping:
                    return
                self._stop.wait(0.1)
        except BaseException as e:  # surfaced by finish(); a waiting writer sees the marker file
            self.error = self._lost_or(e)
            if isinstance(self.error, OwnershipLost):
                self._withdraw()
            (self.out / UPLOAD_FAILED).write_text(f"{type(self.error).__name__}: {self.error}\n")

    def _lost_or(self, e: BaseException) -> BaseException:
        """A failed S3 step of a writer that lost the prefix is that loss (a newer writer aborts the
        uploads open before it took over: this one's part then fails)."""
        if isinstance(e, OwnershipLost) or not isinstance(e, Exception):
            return e
        try:
            self.fence.check()
        except OwnershipLost as lost:
            return lost
        except Exception:
            pass
        return e

    def _withdraw(self) -> None:
        try:
            self.fence.withdraw(self._sent)
        except Exception as e:  # the owner's sweep removes what is left
            print(f"vx: could not remove this writer's unlisted uploads under {self.target}: {e}", file=sys.stderr)

    def raise_if_lost(self) -> None:
        """Called by the job as it takes each sample: a writer that lost stops computing too."""
        if isinstance(self.error, OwnershipLost):
            raise self.error

    def _disk_tight(self) -> bool:
        """Uploaded shards wait for the next manifest flush before local delete; flush early when
        the writer may be waiting for room."""
        return bool(self._to_delete and self.max_local_bytes and
                    local_shard_bytes(self.out) >= self.max_local_bytes // 2)

    def _upload(self, rec: dict) -> None:
        path = self.out / rec["shard"]
        if not path.exists():
            raise VxError(f"{rec['shard']} is committed in {self.out / MANIFEST} but is neither there nor in "
                          f"{self.target} (deleted after upload, and the S3 copy is gone): restore it to S3, or "
                          "rerun with --overwrite to start this output over")
        key = self.target.key(rec["shard"])
        t = time.perf_counter()
        faults.point("before-upload")
        self.fence.check()
        self._sent.add(rec["shard"])
        self.send(path, key, rec)
        faults.point("after-upload")
        if not checksum.head_ok(checksum.head(self.client, self.target.bucket, key), rec):
            raise VxError(f"{key}: uploaded object does not match the manifest (size or {checksum.which(rec)})")
        self.seconds += time.perf_counter() - t
        self.bytes += rec["bytes"]
        self.uploaded.append(rec)
        self._done.add(rec["shard"])
        self._to_delete.append(rec["shard"])

    def send(self, path: Path, key: str, rec: dict) -> None:
        """The file at `path` as this output's bucket's `key`, through the chosen client, with the
        record's checksum: S3 checks the body against its CRC64-NVME on receipt and stores it (full
        object)."""
        if self.crt is not None:
            self.crt.put(path, self.target.bucket, key, checksum.upload_headers(rec),
                         on_part=lambda _: faults.point("upload-part"),
                         on_progress=_progress_points(rec["bytes"], self.crt.part_bytes))
        else:
            self.client.upload_file(str(path), self.target.bucket, key, Config=self.transfer,
                                    ExtraArgs=checksum.upload_args(rec), Callback=lambda _: faults.point("mid-upload"))

    def _flush(self) -> None:
        """Publish the S3 manifest (only verified shards), errors and vx.json; then free local disk."""
        if self.before_publish is not None and len(self.uploaded) > self._announced:
            self.fence.check()  # what it puts is this prefix's too
            self.before_publish()
            self._announced = len(self.uploaded)
        faults.point("before-s3-manifest")
        self.fence.publish(self.uploaded[self._listed:])  # appended: a compare-and-swap on this writer's last put
        self._listed = len(self.uploaded)
        faults.point("after-s3-manifest")
        for name in (ERRORS, RUN_META):  # each once it changed (vx.json: once a run)
            path = self.out / name
            if path.exists() and self._published.get(name) != ((st := path.stat()).st_mtime_ns, st.st_size):
                self.fence.put(name, path.read_bytes())
                self._published[name] = (st.st_mtime_ns, st.st_size)
        if not self.keep_local:
            for name in self._to_delete:
                (self.out / name).unlink(missing_ok=True)
                faults.point("after-delete")
        self._to_delete.clear()
        self._last_flush = time.monotonic()

    def _count_retries(self, parsed=None, **_) -> None:
        self.retries += ((parsed or {}).get("ResponseMetadata") or {}).get("RetryAttempts", 0)

    def figures(self) -> dict:
        """For the run's snapshot (vx/monitor/meter.py): uploaded, waiting, on local disk, retried."""
        return {"bytes_uploaded": self.bytes, "upload_backlog_bytes": max(0, self.committed_bytes - self.bytes),
                "local_bytes": local_shard_bytes(self.out), "upload_retries": self.retries}

    def abandon(self) -> OwnershipLost | None:
        """After the run failed: what is committed still goes up; returns the loss of the prefix
        where that is what stopped the upload (a writer waiting for room says less)."""
        try:
            self.finish()
        except OwnershipLost as e:
            return e
        except Exception:
            pass
        return None

    def finish(self) -> dict:
        """Upload what is left, publish the final manifest; raise if anything failed."""
        self._stop.set()
        self._thread.join()
        if isinstance(self.error, OwnershipLost):
            raise self.error
        if self.error is not None:
            raise VxError(f"upload to {self.target} failed: {self.error}") from self.error
        return {"uploaded_bytes": self.bytes, "upload_mb_s": self.bytes / self.seconds / 1e6 if self.seconds else 0.0}


def _progress_points(size: int, part_bytes: int):
    """`mid-upload` at each report of bytes sent by the CRT client, and `before-multipart-complete`
    at the report of the last bytes of a multipart upload. The client has no hook before it sends
    the completion and may send it while that report runs: a kill there leaves an open upload with
    every part, or a complete object not in the S3 manifest; a rerun recovers either (the open
    upload is aborted, the shard uploaded again). (`upload-part` runs before each part's bytes are
    read, vx/store/crt_s3.py.)"""
    sent = [0]

    def progress(n: int) -> None:
        sent[0] += n
        faults.point("mid-upload")
        if size > part_bytes and sent[0] >= size:
            faults.point("before-multipart-complete")
    return progress


def _upload_part_point(**_) -> None:
    faults.point("upload-part")


def _complete_point(**_) -> None:
    faults.point("before-multipart-complete")
