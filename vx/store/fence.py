"""Who writes an S3 output: one writer a prefix (the root's, or a partition's), fenced by S3's
conditional writes (AWS S3, MinIO and moto honour `If-Match` / `If-None-Match` on PutObject).

The owner token is the prefix's manifest.jsonl itself, and its ETag: a writer publishes it only
with `If-Match` on the ETag of its own last put (`If-None-Match: *` where it found none). The last
record of a manifest names the writer that put it (`published_by`, its attempt id: S3's ETag of a
single put is the MD5 of its bytes, so no two writers' manifests may be equal bytes). A writer takes
the prefix when it starts, in its output lock and before it reads what is committed: it reads the
manifest and puts the same records back under its own name, conditioned on the ETag it read. A
writer that started earlier then finds its chain broken: its next publish fails (412) and it
stops with OwnershipLost (exit code 4), naming the new owner (the manifest's metadata: attempt,
host, pid, start time). Before each of its other writes under the prefix (a shard's upload,
errors.jsonl, vx.json, end.json, progress, --retain-gb's deletes, the one-pass text) a writer
checks that the manifest is still its own put (`check`, a HEAD), so a writer that lost stops at
its next S3 step. Where no shard is published yet there is nothing to take: the first writer to
publish wins, and the other stops at its first publish.

Two attempts never write one key: an S3 output's shard names carry the attempt id of the writer
that wrote them (`shard-00004-<attempt>.safetensors`, vx/store/format.py). A writer that lost
aborts the multipart uploads it opened and deletes the shards it uploaded that the owner's manifest
does not list; a new owner, once it holds the prefix, does the same for what writers before it
left (a writer killed mid-upload): `sweep`.

Where the endpoint ignores the conditions (an old S3-compatible store), the takeover's probe
finds it out and the run stops at preflight with one line (`probe`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import uuid
from dataclasses import dataclass

from vx.errors import OwnershipLost, UsageError, VxError
from vx.store.format import MANIFEST, SHARD_PREFIX

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

    def metadata(self) -> dict[str, str]:
        return {"vx-attempt": self.attempt, "vx-host": self.host, "vx-pid": str(self.pid),
                "vx-started": self.started}

    @classmethod
    def of(cls, metadata: dict | None) -> "Owner | None":
        m = metadata or {}
        if "vx-attempt" not in m:
            return None
        return cls(m["vx-attempt"], m.get("vx-host", "?"), int(m.get("vx-pid", 0) or 0), m.get("vx-started", "?"))

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}, attempt {self.attempt}"


def _code(e) -> str:
    err = getattr(e, "response", {}) or {}
    return str(err.get("Error", {}).get("Code", "")) or str(err.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


class Fence:
    """This process's hold on one S3 prefix. `records`: the manifest it took over."""

    def __init__(self, client, target, owner: Owner, etag: str | None, records: list[dict], taken_at: dt.datetime):
        self.client, self.target, self.owner = client, target, owner
        self.etag, self.records, self.taken_at = etag, records, taken_at
        self.lost: OwnershipLost | None = None

    @property
    def key(self) -> str:
        return self.target.key(MANIFEST)

    @classmethod
    def take(cls, client, target) -> "Fence":
        """Become the writer of target: the manifest's records put back under this writer's name,
        conditioned on the ETag just read (read again where another writer changed it between)."""
        from botocore.exceptions import ClientError

        me = Owner.new()
        key = target.key(MANIFEST)
        for _ in range(TAKE_TRIES):
            try:
                got = client.get_object(Bucket=target.bucket, Key=key)
            except ClientError as e:
                if _code(e) not in ("NoSuchKey", "404"):
                    raise
                return cls(client, target, me, None, [], _server_time(e.response))
            records = parse(got["Body"].read())
            if not records:  # nothing published: the first writer to publish wins
                return cls(client, target, me, got["ETag"], [], _server_time(got))
            try:
                r = client.put_object(Bucket=target.bucket, Key=key, Body=body_of(records, me),
                                      Metadata=me.metadata(), IfMatch=got["ETag"])
            except ClientError as e:
                if _code(e) in LOST_CODES | CONFLICT_CODES:
                    continue  # another writer put it between our read and our put: read again
                raise
            return cls(client, target, me, r["ETag"], records, _server_time(r))
        raise VxError(f"could not take {target}: its manifest changed under each of {TAKE_TRIES} tries "
                      "(another writer keeps publishing); stop the other writer and rerun")

    # -- holding it ------------------------------------------------------------------------------
    def publish(self, records: list[dict]) -> None:
        """The manifest of these records, if it is still this writer's last put (a compare-and-swap
        on its ETag). With none: an empty manifest where there is no manifest yet."""
        from botocore.exceptions import ClientError

        if not records and self.etag is not None:  # an empty manifest is there already
            return self.check()
        cond = {"IfMatch": self.etag} if self.etag else {"IfNoneMatch": "*"}
        for _ in range(3):
            self._raise_if_lost()
            try:
                r = self.client.put_object(Bucket=self.target.bucket, Key=self.key, Body=body_of(records, self.owner),
                                           Metadata=self.owner.metadata(), **cond)
            except ClientError as e:
                code = _code(e)
                if code in CONFLICT_CODES:
                    continue
                if code not in LOST_CODES:
                    raise
                if self._adopt_own_put():  # our put landed and a retry of it was refused
                    return
                self._lose()
            self.etag = r["ETag"]
            return
        self._lose()

    def check(self) -> None:
        """Raise OwnershipLost unless the manifest is still this writer's last put (a HEAD)."""
        from botocore.exceptions import ClientError

        self._raise_if_lost()
        try:
            head = self.client.head_object(Bucket=self.target.bucket, Key=self.key)
        except ClientError as e:
            if _code(e) not in LOST_CODES:
                raise
            if self.etag is None:  # none published yet, by anyone
                return
            self._lose(None)
        if head["ETag"] != self.etag:
            self._lose(Owner.of(head.get("Metadata")))

    def put(self, name: str, body: bytes) -> None:
        """A small file of this prefix, written only while this writer holds it."""
        self.check()
        self.client.put_object(Bucket=self.target.bucket, Key=self.target.key(name), Body=body)

    def _raise_if_lost(self) -> None:
        if self.lost is not None:
            raise self.lost

    def _adopt_own_put(self) -> bool:
        """A put whose response was lost is retried by botocore and refused (the ETag moved, to
        ours): the manifest is ours where its metadata names this attempt."""
        try:
            head = self.client.head_object(Bucket=self.target.bucket, Key=self.key)
        except Exception:
            return False
        if Owner.of(head.get("Metadata")) == self.owner:
            self.etag = head["ETag"]
            return True
        return False

    def _lose(self, other: "Owner | None | bool" = False) -> None:
        if other is False:
            try:
                other = Owner.of(self.client.head_object(Bucket=self.target.bucket, Key=self.key).get("Metadata"))
            except Exception:
                other = None
        by = f"by another writer ({other})" if other else "(its manifest was replaced or deleted: --overwrite?)"
        self.lost = OwnershipLost(
            f"{self.target} was taken over {by}; this writer (attempt {self.owner.attempt}, pid {self.owner.pid} "
            f"on {self.owner.host}) stopped before writing more. Its samples are the owner's to write")
        raise self.lost

    # -- what writers before (or this one, having lost) left --------------------------------------
    def sweep(self, keep: set[str]) -> int:
        """The new owner: abort the multipart uploads and delete the shards (not in `keep`, the
        names this writer lists or will upload) that writers before it left under the prefix
        before it took it. Later ones are a writer's that started after it, or a losing writer's,
        which deletes its own. Returns what it removed."""
        n = 0
        prefix = self.target.key(SHARD_PREFIX)
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.target.bucket,
                                                                                 Prefix=prefix):
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
        `sent`) that the owner's manifest does not list."""
        from botocore.exceptions import ClientError

        try:
            listed = {r["shard"] for r in parse(self.client.get_object(Bucket=self.target.bucket,
                                                                        Key=self.key)["Body"].read())}
        except ClientError as e:
            if _code(e) not in ("NoSuchKey", "404"):
                raise
            listed = set()  # the owner has published nothing yet
        prefix = self.target.key(SHARD_PREFIX)
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.target.bucket,
                                                                                 Prefix=prefix):
            for u in page.get("Uploads", []):
                if u["Key"].rpartition("/")[2] in sent:
                    self.client.abort_multipart_upload(Bucket=self.target.bucket, Key=u["Key"], UploadId=u["UploadId"])
        self._delete([self.target.key(n) for n in sent - listed])

    def _shard_objects(self):
        base = self.target.key("")
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.target.bucket,
                                                                          Prefix=self.target.key(SHARD_PREFIX)):
            for o in page.get("Contents", []):
                if "/" not in o["Key"][len(base):]:
                    yield o

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.target.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


def parse(body: bytes) -> list[dict]:
    return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def body_of(records: list[dict], owner: Owner) -> bytes:
    """A manifest's bytes: one record a line, the last naming the writer that put it."""
    records = [{k: v for k, v in r.items() if k != "published_by"} for r in records]
    if records:
        records[-1]["published_by"] = owner.attempt
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _server_time(response: dict) -> dt.datetime:
    """The S3 server's clock at a response (its Date header; the listing's times are its too)."""
    from email.utils import parsedate_to_datetime

    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    return parsedate_to_datetime(date) if date else dt.datetime.now(dt.timezone.utc)


def probe(client, target) -> None:
    """Preflight: the endpoint refuses a conditional create of a key that exists. One that
    ignores the condition cannot fence two writers: refuse before any compute."""
    from botocore.exceptions import ClientError

    key = target.key(".vx-condition-probe")
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
