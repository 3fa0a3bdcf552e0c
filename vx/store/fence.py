"""Who writes an S3 output: one writer a prefix (the root's, or a partition's), fenced by S3's
conditional writes (AWS S3, MinIO and moto honour `If-Match` / `If-None-Match` on PutObject).

- The owner record, PREFIX/.vx-owner.json (attempt id, host, pid, start time), says who writes the
  prefix. A writer takes it when it starts, in its output lock and before it reads what is
  committed: it puts its own record with `If-Match` on the ETag of the record it read
  (`If-None-Match: *` where there is none). The newest writer wins.
- The manifest is the commit. A writer publishes it only if the owner record is still its own,
  and with `If-Match` on the manifest's ETag as it last read or wrote it (`If-None-Match: *` where
  there was none), appending its new records (the manifest stays append-only: readers follow it
  by offset). A writer that started earlier has its chain broken: its next publish finds the owner
  record another's, or (where it checked a moment before the other took over) its condition
  fails; it stops with OwnershipLost (exit code 4), naming the owner. The condition also keeps the
  new owner from publishing over a record that such an earlier writer put in that moment: then
  both stop, and a rerun continues from what is listed.
- Before each of its other writes under the prefix (a shard's upload, errors.jsonl, vx.json,
  end.json, progress, --retain-gb's deletes, the one-pass text) a writer checks that the owner
  record is still its own (`check`, a HEAD), so a writer that lost stops at its next S3 step.
- Two attempts never write one key: an S3 output's shard names carry the attempt id of the writer
  that wrote them (`shard-00004-<attempt>.safetensors`, vx/store/format.py). A writer that lost
  aborts the multipart uploads it opened and deletes the shards it uploaded that the owner's
  manifest does not list; a new owner deletes what writers before it left there before it took
  the prefix (a writer killed mid-upload): `sweep`.

Where the endpoint ignores the conditions (an old S3-compatible store), preflight's `probe`
finds it out and the run stops before any compute with one line.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass

from vx.errors import OwnershipLost, UsageError, VxError
from vx.store.format import MANIFEST, OWNER, SHARD_PREFIX

LOST_CODES = {"PreconditionFailed", "412", "NoSuchKey", "404", "NotFound"}
CONFLICT_CODES = {"ConditionalRequestConflict", "409"}  # another conditional write of the key in flight
TAKE_TRIES = 20


@dataclass(frozen=True)
class Owner:
    attempt: str
    host: str
    pid: int
    started: str

    @classmethod
    def new(cls) -> "Owner":
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(uuid.uuid4().hex[:8], socket.gethostname(), os.getpid(), now)

    @classmethod
    def of(cls, body: bytes) -> "Owner | None":
        try:
            return cls(**json.loads(body))
        except (ValueError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}, attempt {self.attempt}"


def _code(e) -> str:
    err = getattr(e, "response", {}) or {}
    return str(err.get("Error", {}).get("Code", "")) or str(err.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _missing(e) -> bool:
    return _code(e) in ("NoSuchKey", "404", "NotFound")


class Fence:
    """This process's hold on one S3 prefix. `records`: the manifest's, as it took the prefix."""

    def __init__(self, client, target, owner: Owner, owner_etag: str, etag: str | None, body: bytes,
                 taken_at: dt.datetime):
        self.client, self.target, self.owner = client, target, owner
        self.owner_etag = owner_etag          # of the owner record this writer put
        self.etag, self.body = etag, body     # the manifest as this writer last read or wrote it
        self.taken_at = taken_at              # the S3 server's clock when it took the prefix
        self.records = parse(body)
        self.lost: OwnershipLost | None = None

    def _key(self, name: str) -> str:
        return self.target.key(name)

    @classmethod
    def take(cls, client, target) -> "Fence":
        """Become the writer of target: this writer's owner record, put on the condition that the
        record is still the one just read (read again where another writer changed it in
        between); then the manifest it continues."""
        from botocore.exceptions import ClientError

        me = Owner.new()
        key = target.key(OWNER)
        for _ in range(TAKE_TRIES):
            try:
                cond = {"IfMatch": client.head_object(Bucket=target.bucket, Key=key)["ETag"]}
            except ClientError as e:
                if not _missing(e):
                    raise
                cond = {"IfNoneMatch": "*"}
            try:
                r = client.put_object(Bucket=target.bucket, Key=key, Body=json.dumps(asdict(me)).encode(), **cond)
            except ClientError as e:
                if _code(e) in LOST_CODES | CONFLICT_CODES:
                    continue  # another writer took it between our read and our put: read again
                raise
            break
        else:
            raise VxError(f"could not take {target}: its owner record changed under each of {TAKE_TRIES} tries "
                          "(other writers keep starting); stop them and rerun")
        try:
            got = client.get_object(Bucket=target.bucket, Key=target.key(MANIFEST))
            etag, body = got["ETag"], got["Body"].read()
        except ClientError as e:
            if not _missing(e):
                raise
            etag, body = None, b""
        return cls(client, target, me, r["ETag"], etag, body, _server_time(r))

    # -- holding it ------------------------------------------------------------------------------
    def publish(self, records: list[dict]) -> None:
        """These new records appended to the manifest, while this writer holds the prefix and the
        manifest is as it last read or wrote it (an empty manifest where there is none yet)."""
        from botocore.exceptions import ClientError

        if not records and self.etag is not None:
            return self.check()
        body = self.body + "".join(json.dumps(r) + "\n" for r in records).encode()
        cond = {"IfMatch": self.etag} if self.etag is not None else {"IfNoneMatch": "*"}
        for _ in range(3):
            self.check()
            try:
                r = self.client.put_object(Bucket=self.target.bucket, Key=self._key(MANIFEST), Body=body,
                                           Metadata={"vx-attempt": self.owner.attempt}, **cond)
            except ClientError as e:
                code = _code(e)
                if code in CONFLICT_CODES:
                    continue
                if code not in LOST_CODES:
                    raise
                if self._adopt_own_put(body):  # our put landed and botocore's retry of it was refused
                    return
                self.check()  # taken over since the check above: say by whom
                self._lose(None, "a writer that started before this one published into it after this one took it")
            self.etag, self.body = r["ETag"], body
            return
        self.check()
        self._lose(None, "other writes of its manifest kept conflicting with this writer's")

    def check(self) -> None:
        """Raise OwnershipLost unless the owner record is still this writer's (a HEAD)."""
        from botocore.exceptions import ClientError

        if self.lost is not None:
            raise self.lost
        try:
            head = self.client.head_object(Bucket=self.target.bucket, Key=self._key(OWNER))
        except ClientError as e:
            if not _missing(e):
                raise
            self._lose(None, "its owner record was deleted (--overwrite?)")
        if head["ETag"] != self.owner_etag:
            self._lose(self._owner())

    def put(self, name: str, body: bytes) -> None:
        """A small file of this prefix, written only while this writer holds it."""
        self.check()
        self.client.put_object(Bucket=self.target.bucket, Key=self._key(name), Body=body)

    def _owner(self) -> "Owner | None":
        try:
            return Owner.of(self.client.get_object(Bucket=self.target.bucket, Key=self._key(OWNER))["Body"].read())
        except Exception:
            return None

    def _adopt_own_put(self, body: bytes) -> bool:
        """A put whose response was lost is retried by botocore and refused (the ETag moved, to
        ours): the manifest is ours where its metadata names this attempt."""
        try:
            head = self.client.head_object(Bucket=self.target.bucket, Key=self._key(MANIFEST))
        except Exception:
            return False
        if head.get("Metadata", {}).get("vx-attempt") == self.owner.attempt and head["ContentLength"] == len(body):
            self.etag, self.body = head["ETag"], body
            return True
        return False

    def _lose(self, other: "Owner | None", why: str = "") -> None:
        by = f"by another writer ({other})" if other else f"({why})"
        self.lost = OwnershipLost(
            f"{self.target} was taken over {by}; this writer (attempt {self.owner.attempt}, pid {self.owner.pid} "
            f"on {self.owner.host}) stopped before writing more. Its samples are the owner's to write"
            + ("" if other else "; rerun the same command to continue"))
        raise self.lost

    # -- what writers before (or this one, having lost) left --------------------------------------
    def sweep(self, keep: set[str]) -> int:
        """The new owner: abort the multipart uploads and delete the shards (not in `keep`, the
        names this writer lists or will upload) that writers before it left under the prefix
        before it took it. Later ones are a writer's that started after it, or a losing writer's,
        which deletes its own. Returns what it removed."""
        n = 0
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.target.bucket,
                                                                                 Prefix=self._key(SHARD_PREFIX)):
            for u in page.get("Uploads", []):
                if u["Initiated"] <= self.taken_at:
                    self.client.abort_multipart_upload(Bucket=self.target.bucket, Key=u["Key"], UploadId=u["UploadId"])
                    n += 1
        stale = [o["Key"] for o in self._shard_objects() if o["Key"].rpartition("/")[2] not in keep
                 and o["LastModified"] <= self.taken_at]
        self.check()  # still ours: nothing of a later owner is among them
        self._delete(stale)
        return n + len(stale)

    def withdraw(self, sent: set[str]) -> None:
        """This writer lost: abort its open uploads and delete the shards it uploaded (names in
        `sent`) that the manifest does not list."""
        from botocore.exceptions import ClientError

        try:
            listed = {r["shard"] for r in parse(self.client.get_object(Bucket=self.target.bucket,
                                                                        Key=self._key(MANIFEST))["Body"].read())}
        except ClientError as e:
            if not _missing(e):
                raise
            listed = set()  # the owner has published nothing yet
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.target.bucket,
                                                                                 Prefix=self._key(SHARD_PREFIX)):
            for u in page.get("Uploads", []):
                if u["Key"].rpartition("/")[2] in sent:
                    self.client.abort_multipart_upload(Bucket=self.target.bucket, Key=u["Key"], UploadId=u["UploadId"])
        self._delete([self._key(n) for n in sent - listed])

    def _shard_objects(self):
        base = self._key("")
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.target.bucket,
                                                                          Prefix=self._key(SHARD_PREFIX)):
            for o in page.get("Contents", []):
                if "/" not in o["Key"][len(base):]:
                    yield o

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.target.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


def parse(body: bytes) -> list[dict]:
    return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def _server_time(response: dict) -> dt.datetime:
    """The S3 server's clock at a response (its Date header; the listing's times are its too)."""
    from email.utils import parsedate_to_datetime

    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    return parsedate_to_datetime(date) if date else dt.datetime.now(dt.timezone.utc)


def probe(client, target) -> None:
    """Preflight: the endpoint refuses a conditional create of a key that exists. One that
    ignores the condition cannot fence two writers: refuse before any compute."""
    from botocore.exceptions import ClientError

    key = target.key(f".vx-condition-probe-{uuid.uuid4().hex[:12]}")  # its own: partition workers probe at once
    client.put_object(Bucket=target.bucket, Key=key, Body=b"")
    try:
        client.put_object(Bucket=target.bucket, Key=key, Body=b"", IfNoneMatch="*")
        honoured = False
    except ClientError as e:
        honoured = _code(e) in LOST_CODES | CONFLICT_CODES
    finally:
        client.delete_object(Bucket=target.bucket, Key=key)
    if not honoured:
        raise UsageError(f"the S3 endpoint of {target} does not honour conditional writes (If-None-Match on "
                         "PutObject), which vx needs to keep a second writer of the output from corrupting it; "
                         "use AWS S3, MinIO or another store that does")
