"""An output under s3://bucket/prefix: preflight before any compute, the remote manifests and
layout (resume on a new machine, committed ids, --overwrite). The upload itself is
vx/store/uploader.py."""

from __future__ import annotations

import json
from pathlib import Path

from vx.errors import UsageError
from vx.store.s3_client import S3Target, make_client
from vx.store.format import DROPPED, MANIFEST, READERS, RUN_FILES, RUN_META, TEXT_ERRORS, TEXT_FILES, TEXT_SEGMENTS
from vx.store.fence import probe as conditional_writes_probe
from vx.store.lock import write_atomically


def preflight(target: S3Target, endpoint_url: str | None) -> None:
    """Fail fast, before any compute: unreachable endpoint, bad credentials, missing bucket, no write."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
    )

    client = make_client(endpoint_url, attempts=2, connect_timeout=3)
    where = f"{target}" + (f" at {endpoint_url}" if endpoint_url else "")
    try:
        client.head_bucket(Bucket=target.bucket)
        probe = target.key(".vx-write-probe")
        client.put_object(Bucket=target.bucket, Key=probe, Body=b"")
        client.delete_object(Bucket=target.bucket, Key=probe)
        conditional_writes_probe(client, target)  # refused in one line where the endpoint ignores them
    except NoCredentialsError:
        raise UsageError(f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a "
                         "profile, or an instance role") from None
    except EndpointConnectionError:
        raise UsageError(f"cannot reach the S3 endpoint for {where}") from None
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise UsageError(f"bucket {target.bucket!r} does not exist ({where})") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise UsageError(f"access denied to {where} ({code}): check the credentials and the bucket policy") from None
        raise UsageError(f"S3 error on {where}: {code}") from None
    except BotoCoreError as e:
        raise UsageError(f"S3 error on {where}: {type(e).__name__}") from None


def fetch_remote_state(target: S3Target, endpoint_url: str | None, out: Path) -> bool:
    """Resume on a new machine: copy the S3 manifest, errors and vx.json into an empty local dir."""
    if (out / MANIFEST).exists():
        return False
    client = make_client(endpoint_url)
    got = False
    for name in (RUN_META, MANIFEST):
        got |= fetch_file(target, name, out / name, client)
    return got


def fetch_file(target: S3Target, name: str, dest: Path, client) -> bool:
    """target's file `name` into dest, written atomically; False when there is none. (The partition
    workers of one machine share a staging directory and may fetch one file at once: a plain write
    let one read the other's half-written vx.json, found by the suite.)"""
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=target.bucket, Key=target.key(name))["Body"].read()
    except ClientError:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(dest, body)
    return True


def fetch_layout_meta(client, target: S3Target, out: Path) -> list[str]:
    """Copy vx.json and every manifest under target (root and partitions) into out, keeping the
    layout; returns their names. Raises UsageError when target holds no vx output."""
    names = [name for _, name in layout_names(client, target)
             if name.rpartition("/")[2] in (RUN_META, MANIFEST, DROPPED)]
    if RUN_META not in names or not any(n.endswith(MANIFEST) for n in names):
        raise UsageError(f"{target} has no {RUN_META} and {MANIFEST}; is it a vx output?")
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(target.bucket, target.key(name), str(out / name))
    return names


def remote_manifest(target: S3Target, endpoint_url: str | None, client=None) -> list[dict]:
    """The records of the manifest at target (not its partitions'); [] when there is none."""
    from botocore.exceptions import ClientError

    client = client or make_client(endpoint_url)
    try:
        body = client.get_object(Bucket=target.bucket, Key=target.key(MANIFEST))["Body"].read()
    except ClientError:
        return []
    return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def remote_dropped(target: S3Target, endpoint_url: str | None) -> set[str]:
    """Shards of the manifest at target that --retain-gb deleted once consumed (dropped.jsonl)."""
    from botocore.exceptions import ClientError

    try:
        body = make_client(endpoint_url).get_object(Bucket=target.bucket, Key=target.key(DROPPED))["Body"].read()
    except ClientError:
        return set()
    return {json.loads(line)["shard"] for line in body.decode().splitlines() if line.strip()}


def remote_has_extraction(target: S3Target, endpoint_url: str | None) -> bool:
    """Whether any vx file (vx.json, a manifest, a shard; root or partitions) is under target."""
    return next(layout_names(make_client(endpoint_url), target), None) is not None


def layout_names(client, target: S3Target):
    """(key, name relative to the prefix) of every vx file under target: root and part-*/ files,
    follow readers' records and the one-pass mode's regenerated text."""
    from vx.store.format import PART_RE

    for page in client.get_paginator("list_objects_v2").paginate(Bucket=target.bucket, Prefix=target.key("")):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(target.key("")):]
            head, _, base = name.rpartition("/")
            if (not head or PART_RE.match(head)) and (base.startswith("shard-") or base in RUN_FILES):
                yield obj["Key"], name
            elif head == READERS:  # follow readers' records: --overwrite starts a new stream
                yield obj["Key"], name
            elif (not head and base in TEXT_FILES) or head in (TEXT_SEGMENTS, TEXT_ERRORS):  # the one-pass mode's text
                yield obj["Key"], name


def remote_committed_ids(target: S3Target, endpoint_url: str | None, exclude: str | None = "") -> set[str]:
    """Sample ids in every S3 manifest under target (root and partitions) but the one in `exclude`
    (a partition's directory name, "" for the root, None for none)."""
    client = make_client(endpoint_url)
    ids: set[str] = set()
    for key, name in layout_names(client, target):
        head, _, base = name.rpartition("/")
        if base == MANIFEST and head != exclude:
            body = client.get_object(Bucket=target.bucket, Key=key)["Body"].read().decode()
            ids.update(sid for line in body.splitlines() if line.strip() for sid in json.loads(line)["sample_ids"])
    return ids


def remote_exists(target: S3Target, endpoint_url: str | None, name: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        make_client(endpoint_url).head_object(Bucket=target.bucket, Key=target.key(name))
    except ClientError:
        return False
    return True


def put_file(target: S3Target, endpoint_url: str | None, path: Path, name: str) -> None:
    make_client(endpoint_url).upload_file(str(path), target.bucket, target.key(name))


def put_new(target: S3Target, endpoint_url: str | None, path: Path, name: str) -> None:
    """path as target's `name` only where there is none yet (a conditional create)."""
    from botocore.exceptions import ClientError

    try:
        make_client(endpoint_url).put_object(Bucket=target.bucket, Key=target.key(name), Body=path.read_bytes(),
                                             IfNoneMatch="*")
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
            raise


def clear_remote(target: S3Target, endpoint_url: str | None) -> int:
    """--overwrite: delete an earlier extraction under the prefix (its layout's files only)."""
    client = make_client(endpoint_url)
    names = [key for key, _ in layout_names(client, target)]
    for i in range(0, len(names), 1000):
        client.delete_objects(Bucket=target.bucket, Delete={"Objects": [{"Key": k} for k in names[i:i + 1000]]})
    return len(names)



