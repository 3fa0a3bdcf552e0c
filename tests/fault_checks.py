"""The invariants a fault campaign trial checks after its rerun (tests/fault_campaign.py).

Each check reads what the run left (local files, or S3 over HTTP) with its own code, not vx's
writer or reader paths: manifests parsed here, checksums computed here with awscrt (the CRC S3
itself uses), safetensors headers parsed here, processes found through /proc. Each returns a list
of violations (strings); an empty list is a pass.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np
from awscrt import checksums

SHARD_PREFIX = "shard-"
_NP = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "U8": np.uint8, "BOOL": np.bool_, "F32": np.float32}


def crc64(data: bytes) -> str:
    return base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode()


class Output:
    """A finished output's files by relative name -> bytes, from a local directory or an S3 prefix."""

    def __init__(self, files: dict[str, bytes], remote_keys: list[str] | None = None):
        self.files, self.remote_keys = files, remote_keys

    @classmethod
    def local(cls, root: Path) -> "Output":
        return cls({str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()})

    @classmethod
    def s3(cls, client, bucket: str, prefix: str) -> "Output":
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
                for o in page.get("Contents", [])]
        files = {k[len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
        return cls(files, [k[len(prefix) + 1:] for k in keys])

    def dirs(self) -> list[str]:
        """"" (the root) and each partition directory holding a manifest."""
        return sorted({n.rpartition("/")[0] for n in self.files if n.rpartition("/")[2] == "manifest.jsonl"})

    def records(self, d: str) -> list[dict]:
        body = self.files.get(_join(d, "manifest.jsonl"), b"").decode()
        lines = body.split("\n")
        return [json.loads(x) for x in lines if x.strip()]

    def dropped(self, d: str) -> set[str]:
        body = self.files.get(_join(d, "dropped.jsonl"), b"").decode()
        return {json.loads(x)["shard"] for x in body.splitlines() if x.strip()}


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def exactly_once(out: Output, want_ids: list[str]) -> list[str]:
    ids = Counter(sid for d in out.dirs() for r in out.records(d) for sid in r["sample_ids"])
    bad = []
    doubled = sorted(s for s, n in ids.items() if n > 1)
    lost = sorted(set(want_ids) - set(ids))
    extra = sorted(set(ids) - set(want_ids))
    if doubled:
        bad.append(f"samples committed more than once: {doubled[:5]} ({len(doubled)})")
    if lost:
        bad.append(f"samples lost: {lost[:5]} ({len(lost)})")
    if extra:
        bad.append(f"samples not in the dataset: {extra[:5]}")
    for d in out.dirs():
        body = out.files[_join(d, "manifest.jsonl")]
        if body and not body.endswith(b"\n"):
            bad.append(f"{_join(d, 'manifest.jsonl')} ends in a torn line")
    return bad


def checksums_pass(out: Output) -> tuple[list[str], dict[str, dict]]:
    """Every committed, undropped shard present with the manifest's size and CRC64-NVME; returns the
    violations and each shard's parsed header by name (for the states check)."""
    bad, headers = [], {}
    for d in out.dirs():
        dropped = out.dropped(d)
        for r in out.records(d):
            name = _join(d, r["shard"])
            if r["shard"] in dropped:
                continue
            body = out.files.get(name)
            if body is None:
                bad.append(f"{name} is committed but missing")
                continue
            if len(body) != r["bytes"]:
                bad.append(f"{name}: {len(body)} bytes, the manifest says {r['bytes']}")
            elif "crc64nvme" in r and crc64(body) != r["crc64nvme"]:
                bad.append(f"{name}: CRC64-NVME differs from the manifest's")
            else:
                headers[name] = _header(body)
                ids = json.loads(headers[name]["__metadata__"]["sample_ids"])
                if ids != r["sample_ids"]:
                    bad.append(f"{name}: holds {ids[:3]}..., its manifest record says {r['sample_ids'][:3]}...")
    return bad, headers


def _header(body: bytes) -> dict:
    (n,) = struct.unpack("<Q", body[:8])
    return json.loads(body[8:8 + n])


def rows_of(body: bytes, header: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """sample id -> (input_ids [T], hidden_states [T, L, H] as float32) of an uncompressed bf16/fp32 shard."""
    (n,) = struct.unpack("<Q", body[:8])
    base = 8 + n

    def arr(name, dtype=None):
        a, b = header[name]["data_offsets"]
        return np.frombuffer(body[base + a:base + b], dtype=dtype or _NP[header[name]["dtype"]])

    h = header["hidden_states"]
    if h["dtype"] == "BF16":
        hidden = (arr("hidden_states", np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        hidden = arr("hidden_states", np.float32)
    hidden = hidden.reshape(h["shape"])
    ids, offsets = arr("input_ids"), arr("offsets")
    names = json.loads(header["__metadata__"]["sample_ids"])
    return {s: (ids[offsets[i]:offsets[i + 1]], hidden[offsets[i]:offsets[i + 1]]) for i, s in enumerate(names)}


def states_match(out: Output, headers: dict[str, dict], reference: dict, min_cos: float) -> list[str]:
    """Every stored sample's input ids equal a clean run's and each of its rows within min_cos of it:
    no zero rows, no rows of another sample or another position."""
    bad = []
    for name, header in headers.items():
        if "hidden_scales" in header:
            continue
        for sid, (ids, hidden) in rows_of(out.files[name], header).items():
            ref_ids, ref_hidden = reference[sid]
            if not np.array_equal(ids, ref_ids):
                bad.append(f"{name}:{sid}: input ids differ from a clean run's")
                continue
            a, b = hidden.reshape(-1, hidden.shape[-1]), ref_hidden.reshape(-1, ref_hidden.shape[-1])
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)
            if cos.min() < min_cos:
                bad.append(f"{name}:{sid}: a row at cosine {cos.min():.4f} of a clean run's (bound {min_cos})")
    return bad


def s3_listing_agrees(out: Output, client, bucket: str, prefix: str) -> list[str]:
    """The prefix's shard objects are exactly the committed, undropped shards; no multipart upload
    left open under it."""
    bad = []
    listed = {k for k in out.remote_keys if k.rpartition("/")[2].startswith(SHARD_PREFIX)}
    want = {_join(d, r["shard"]) for d in out.dirs() for r in out.records(d) if r["shard"] not in out.dropped(d)}
    if listed - want:
        bad.append(f"S3 holds shards no manifest lists: {sorted(listed - want)[:5]}")
    if want - listed:
        bad.append(f"S3 lacks committed shards: {sorted(want - listed)[:5]}")
    open_uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    if open_uploads:
        bad.append(f"multipart uploads left open: {[u['Key'] for u in open_uploads][:5]}")
    return bad


def text_matches_states(out: Output, headers: dict[str, dict], regenerated: bytes, render) -> list[str]:
    """The one-pass mode: every stored conversation's input ids are its regenerated text's, as
    render(messages) -> ids gives them (the tokenizer's own chat template)."""
    text = {json.loads(x)["id"]: json.loads(x)["messages"] for x in regenerated.splitlines() if x.strip()}
    bad = []
    for name, header in headers.items():
        for sid, (ids, _) in rows_of(out.files[name], header).items():
            if sid in text and ids.tolist() != render(text[sid]):
                bad.append(f"{name}:{sid}: stored ids are not those of its regenerated text")
    return bad


def no_temp_files(*roots: Path) -> list[str]:
    """Nothing half-written left beside committed files (temp shards, temp manifests). A temp file
    named for a process still running (vx.store.lock.temp_for: .NAME.HOST.PID.tmp, a follow
    reader's record being written as the check looks) is in flight, not left."""
    def in_flight(p: Path) -> bool:
        pid = p.name[:-len(".tmp")].rpartition(".")[2] if p.name.endswith(".tmp") else ""
        return pid.isdigit() and Path(f"/proc/{pid}").exists()

    left = [str(p) for root in roots if root.exists() for p in root.rglob("*")
            if p.is_file() and (p.name.endswith(".tmp") or (p.name.startswith(".shard-"))) and not in_flight(p)]
    return [f"temp files left: {left[:5]}"] if left else []


def staging_empty(staging: Path) -> list[str]:
    """An S3 output's local staging holds no shard once the run ended (all uploaded and deleted)."""
    left = [str(p) for p in staging.rglob("shard-*")] if staging.exists() else []
    return [f"staging still holds shards: {left[:5]}"] if left else []


def jsonl_once(path: Path, want_ids: list[str]) -> list[str]:
    """A JSONL output (vx regenerate's): whole lines only, every id once."""
    if not path.exists():
        return [f"{path} missing"]
    body = path.read_bytes()
    if body and not body.endswith(b"\n"):
        return [f"{path} ends in a torn line"]
    ids = Counter(json.loads(x)["id"] for x in body.splitlines() if x.strip())
    bad = []
    if sorted(ids) != sorted(want_ids):
        bad.append(f"{path.name}: {len(set(want_ids) - set(ids))} conversations lost, "
                   f"{len(set(ids) - set(want_ids))} unknown")
    if any(n > 1 for n in ids.values()):
        bad.append(f"{path.name}: conversations written twice: {[k for k, n in ids.items() if n > 1][:5]}")
    return bad


def follow_saw_once(seen_file: Path, want_ids: list[str]) -> list[str]:
    if not seen_file.exists():
        return ["the follow reader wrote nothing"]
    seen = Counter(s for line in seen_file.read_text().splitlines() if line.strip() for s in json.loads(line))
    bad = []
    if set(seen) != set(want_ids):
        bad.append(f"the follow reader missed {len(set(want_ids) - set(seen))} samples")
    if any(n > 1 for n in seen.values()):
        bad.append(f"the follow reader saw samples twice: {[k for k, n in seen.items() if n > 1][:5]}")
    return bad
