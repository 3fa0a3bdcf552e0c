"""Shard files and the manifest: the on-disk format (vx/store/writer.py writes it).

A shard `shard-NNNNN.safetensors` holds N samples packed along the token axis (in an S3 output
`shard-NNNNN-<attempt>.safetensors`: the id of the writer that wrote it, vx/store/fence.py):
  hidden_states [sum T, L, H]  store dtype (bf16 default)
  input_ids     [sum T]        int32
  loss_mask     [sum T]        uint8
  offsets       [N + 1]        int64   sample i is rows offsets[i]:offsets[i+1]
Its safetensors metadata (all strings): format="vx-shard-1", sample_ids (JSON list), model,
layer_ids (JSON list), hidden_size, num_layers, store_dtype, vx_version. With --compress blocks
hidden_states is stored coded in blocks of rows instead (vx/store/blocks.py).

A shard is written under a temp name, fsynced, renamed, and only then recorded by one line in
`manifest.jsonl` (fsynced): that line is the commit, with the shard's size and CRC64-NVME. Readers trust the manifest alone, so a torn
temp file or an unrecorded shard left by a crash is invisible.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from vx import faults
from vx.store.checksum import Crc64

MANIFEST = "manifest.jsonl"
SHARD_PREFIX = "shard-"
ERRORS = "errors.jsonl"
RUN_META = "vx.json"
SHARD_FORMAT = "vx-shard-1"

ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
            torch.uint8: "U8", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3"}  # torch -> safetensors name
TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}  # and back (the readers')


def row_bytes(dtype: torch.dtype, shape) -> int:
    """Bytes of one row (index along the first dim) of a tensor of `shape`."""
    n = dtype.itemsize
    for d in shape[1:]:
        n *= d
    return n


def shard_name(index: int, compress: str | None = None, attempt: str | None = None) -> str:
    """attempt: an S3 output's writer's id (vx/store/fence.py), so two attempts never write one key."""
    return f"{SHARD_PREFIX}{index:05d}" + (f"-{attempt}" if attempt else "") + ".safetensors" + \
        (".zst" if compress == "zstd" else "")


class _HashingFile:
    """A file wrapper that checksums and counts what is written (the stored, compressed bytes)."""

    def __init__(self, f):
        self.f, self.crc = f, Crc64()

    def write(self, b) -> int:
        self.crc.update(b)
        return self.f.write(b)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _nbytes(p) -> int:
    return p.numel() * p.element_size() if isinstance(p, torch.Tensor) else memoryview(p).nbytes


def write_safetensors(path: Path, tensors: dict[str, list], shapes: dict[str, list[int]],
                      metadata: dict[str, str], compress: str | None = None) -> tuple[int, str]:
    """Write a safetensors file whose tensors are given as lists of contiguous CPU pieces (tensors,
or buffers of bytes for a U8 tensor).

    Streams the pieces (no concatenated copy), fsyncs, returns (bytes, CRC64-NVME as S3 writes it:
    vx/store/checksum.py), computed on each piece as it goes out (~23 GB/s, inline).
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, pieces in tensors.items():
        nbytes = sum(_nbytes(p) for p in pieces)
        header[name] = {"dtype": ST_DTYPE[pieces[0].dtype] if pieces and isinstance(pieces[0], torch.Tensor)
                        else "U8", "shape": shapes[name], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    if compress == "zstd":  # the whole file as one zstd frame; the checksum of the stored bytes
        import zstandard

        with open(path, "wb") as f:
            out = _HashingFile(f)
            with zstandard.ZstdCompressor(level=1, threads=-1).stream_writer(out, closefd=False) as z:
                for buf in _buffers(len(blob).to_bytes(8, "little") + blob, tensors):
                    z.write(buf)
            f.flush()
            faults.point("before-shard-fsync")
            os.fsync(f.fileno())
        return out.crc.n, out.crc.encoded()
    crc = Crc64()
    with open(path, "wb") as f:
        for i, buf in enumerate(_buffers(len(blob).to_bytes(8, "little") + blob, tensors)):
            if i == 2:
                faults.point("mid-shard-write")
            crc.update(buf)
            f.write(buf)
        f.flush()
        faults.point("before-shard-fsync")
        os.fsync(f.fileno())
    return 8 + len(blob) + offset, crc.encoded()


def _buffers(head: bytes, tensors: dict[str, list[torch.Tensor]]):
    yield memoryview(head)
    for pieces in tensors.values():
        for p in pieces:
            yield memoryview(p.contiguous().view(torch.uint8).numpy()) if isinstance(p, torch.Tensor) else \
                memoryview(p).cast("B")


# A partition's own output directory under the root: part-00003-of-00008/
PART_RE = re.compile(r"^part-\d{5}-of-\d{5}$")


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def part_dirs(root: Path) -> list[Path]:
    """Partition outputs under root (any partition count, e.g. an 8-way run resumed 4-way), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and PART_RE.match(p.name))


def output_dirs(root: Path) -> list[Path]:
    """Every directory whose manifest is part of the dataset at root: root itself, then partitions."""
    return [Path(root)] + part_dirs(root)


def read_manifest(out_dir: Path) -> list[dict]:
    """Committed shard records. A torn last line (crash mid-append) is ignored."""
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def write_manifest(path: Path, records: list[dict]) -> None:
    from vx.store.lock import write_atomically

    write_atomically(path, "".join(json.dumps(r) + "\n" for r in records), durable=True)


def repair_manifest(path: Path) -> None:
    """Drop a torn last line (a crash mid-append) so new records start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data[: data.rfind(b"\n") + 1]
        faults.point("repair-manifest")
        with open(path, "wb") as f:
            f.write(keep)
            f.flush()
            os.fsync(f.fileno())


PLAN_DIR = ".vx-plan"

# Written by a run (the whole output, or one partition of it) when every one of its rows is
# committed or rejected: {"shards": K} (its manifest's K records are final). Removed when a run
# starts. A follow reader (vx.loader(..., follow=True)) ends the stream on it.
END = "end.json"
READERS = ".vx-readers"     # follow readers' consumption records: rank-R-of-W.json
DROPPED = "dropped.jsonl"   # shards deleted by --retain-gb once consumed: one {"shard": name} per line
PROGRESS = "progress.json"  # each writer's latest figures (vx/store/progress_log.py), every few seconds
HISTORY = "progress.jsonl"  # and every snapshot it took, appended: vx inspect --plot
RETAIN = "retain.json"       # at the root while --retain-gb holds: {"retain_gb": G, "writers": P}
# the files of a run at the top of an output (or partition) directory, beside its shards: what
# --overwrite deletes, here and under the S3 prefix
OWNER = ".vx-owner.json"    # with S3: the writer that holds the prefix (vx/store/fence.py)
RUN_FILES = (MANIFEST, ERRORS, RUN_META, END, DROPPED, PROGRESS, HISTORY, OWNER)
# `vx extract --regenerate`'s conversations, at the root (vx/jobs/one_pass.py); under an S3
# prefix also in segments while runs go on (vx/jobs/regenerated_text.py)
REGENERATED = "regenerated.jsonl"
GENERATION = "regenerate.json"  # how they were generated: a rerun continues only with the same options
TEXT_SEGMENTS = REGENERATED + ".d"
TEXT_ERRORS = REGENERATED + ".errors.d"  # partitions' bad records, one object each, merged into the root's errors file
TEXT_FILES = (REGENERATED, REGENERATED + ".errors.jsonl", GENERATION)
