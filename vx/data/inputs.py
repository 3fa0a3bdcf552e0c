"""The input: a dataset given as a file, a directory, a glob or an s3:// URL, read as one ordered
stream of records, never loaded whole.

Formats are sniffed from each file's first bytes (a gzipped file named .jsonl still reads):
JSONL (plain, gzip, zstd), parquet (one row group at a time), Arrow IPC streams (what
`datasets.save_to_disk` writes; a `save_to_disk` directory is read in its own file order).
Rows are numbered 1.. across the whole input in a stable order (files sorted by name; a JSONL
file counts every physical line, blank ones too, so a one-file dataset's row is its line
number): the partition plan, resume and errors.jsonl all use that number.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vx.data.formats import (
    ARROW_FILE,
    ARROW_STREAM,
    PARQUET,
    SUFFIXES,
    BodyReader,
    count_lines,
    decompressed,
    json_lines,
    looks_like,
    sniff,
    supported,
    table_rows,
)
from vx.errors import UsageError


@dataclass(frozen=True)
class InputFile:
    name: str              # local path or s3://bucket/key
    size: int
    version: str = ""      # S3 ETag: part of the input's fingerprint

    @property
    def short(self) -> str:
        return self.name if self.name.startswith("s3://") else os.path.basename(self.name)


@dataclass
class Row:
    index: int             # 1-based across the whole input
    file: InputFile
    row: int               # 1-based within its file (the line, for JSONL)
    record: dict | None    # None for a blank JSONL line
    bad: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file.short}:{self.row}"


class Input:
    """The dataset named by `spec`: resolved to an ordered list of files at construction."""

    def __init__(self, spec: str | Path, endpoint_url: str | None = None, files: list[InputFile] | None = None):
        self.spec, self.endpoint_url = str(spec), endpoint_url
        self.files = files if files is not None else self._resolve()

    def __str__(self) -> str:
        return self.spec

    # -- which files -------------------------------------------------------------------------------
    def _resolve(self) -> list[InputFile]:
        if self.spec.startswith("s3://"):
            return self._resolve_s3()
        path = Path(self.spec).expanduser()
        if any(c in self.spec for c in "*?["):
            names = sorted(p for p in globlib.glob(str(path), recursive=True) if os.path.isfile(p))
            if not names:
                raise UsageError(f"dataset glob {self.spec!r} matches no file")
            return [self._local(n) for n in names]
        if path.is_file():
            return [self._local(path)]
        if path.is_dir():
            return self._resolve_dir(path)
        raise UsageError(f"dataset {self.spec!r} is not a file, a directory, a glob or an s3:// URL")

    @staticmethod
    def _local(path) -> InputFile:
        return InputFile(str(path), os.path.getsize(path))

    def _resolve_dir(self, path: Path) -> list[InputFile]:
        if (path / "dataset_dict.json").exists():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise UsageError(f"{path} is a datasets DatasetDict; give one split, e.g. {path / (splits or ['train'])[0]}")
        if (path / "state.json").exists() and (path / "dataset_info.json").exists():  # datasets.save_to_disk
            files = [f["filename"] for f in json.loads((path / "state.json").read_text()).get("_data_files", [])]
            return [self._local(path / f) for f in files]
        names = sorted(str(p) for p in path.rglob("*") if p.is_file() and supported(p.name)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not names:
            raise UsageError(f"directory {path} holds no dataset file ({', '.join(SUFFIXES)})")
        return [self._local(n) for n in names]

    def _client(self):
        from vx.store.s3_client import make_client

        return make_client(self.endpoint_url)

    def _resolve_s3(self) -> list[InputFile]:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, key = self.spec[5:].partition("/")
        client = self._client()
        try:
            if key and not key.endswith("/"):
                try:
                    head = client.head_object(Bucket=bucket, Key=key)
                    return [InputFile(self.spec, head["ContentLength"], head.get("ETag", ""))]
                except ClientError as e:
                    if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                        raise
                key += "/"
            out = []
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
                for obj in page.get("Contents", []):
                    if supported(obj["Key"]) and not os.path.basename(obj["Key"]).startswith("."):
                        out.append(InputFile(f"s3://{bucket}/{obj['Key']}", obj["Size"], obj.get("ETag", "")))
        except (ClientError, BotoCoreError) as e:
            raise UsageError(f"cannot list dataset {self.spec}: {e}") from None
        if not out:
            raise UsageError(f"dataset {self.spec} matches no object ({', '.join(SUFFIXES)})")
        return sorted(out, key=lambda f: f.name)

    # -- reading -----------------------------------------------------------------------------------
    def rows(self) -> Iterator[Row]:
        """Every row of every file, in order, numbered across the input."""
        index = 0
        for f in self.files:
            for row, record, bad in self.file_rows(f):
                index += 1
                yield Row(index, f, row, record, bad)

    def file_rows(self, f: InputFile) -> Iterator[tuple[int, dict | None, str | None]]:
        """(row in file, record or None for a blank line, reason when bad) of one file."""
        with self._open(f) as raw:
            kind = sniff(raw.peek(8)[:8])
            if kind in (PARQUET, ARROW_FILE):
                yield from table_rows(self._seekable(f, raw), kind)
            elif kind == ARROW_STREAM:
                yield from table_rows(raw, kind)
            else:
                yield from json_lines(decompressed(raw, kind))

    def head(self, f: InputFile, n: int = 256) -> bytes:
        with self._open(f) as raw:
            return raw.peek(n)[:n]

    def _open(self, f: InputFile) -> io.BufferedReader:
        if not f.name.startswith("s3://"):
            return open(f.name, "rb", buffering=1 << 20)
        bucket, _, key = f.name[5:].partition("/")
        body = self._client().get_object(Bucket=bucket, Key=key)["Body"]
        return io.BufferedReader(BodyReader(body), buffer_size=1 << 20)

    def _seekable(self, f: InputFile, raw):
        """Parquet needs random access: a local file as is, an S3 object via one temporary copy."""
        if not f.name.startswith("s3://"):
            return f.name
        tmp = tempfile.TemporaryFile(prefix="vx-input-")
        while chunk := raw.read(8 << 20):
            tmp.write(chunk)
        tmp.seek(0)
        return tmp

    def count(self) -> int | None:
        """Non-blank rows, for the progress bar's total; None where counting means a full download."""
        if any(f.name.startswith("s3://") for f in self.files):
            return None
        return sum(self._count_file(f) for f in self.files)

    def _count_file(self, f: InputFile) -> int:
        with self._open(f) as raw:
            kind = sniff(raw.peek(8)[:8])
            if kind not in (PARQUET, ARROW_FILE, ARROW_STREAM):  # JSONL: no pyarrow to import (~0.25 s)
                return count_lines(decompressed(raw, kind))
            import pyarrow as pa
            import pyarrow.parquet as pq

            if kind == PARQUET:
                return pq.ParquetFile(f.name).metadata.num_rows
            if kind == ARROW_FILE:
                reader = pa.ipc.open_file(f.name)
                return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            return sum(b.num_rows for b in pa.ipc.open_stream(raw))

    def fingerprint(self) -> str:
        """The input's content (local: its bytes; S3: keys, sizes and ETags), for the plan cache key."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.short}\0{f.size}\0{f.version}\0".encode())
            if not f.name.startswith("s3://"):
                with open(f.name, "rb") as fh:
                    while chunk := fh.read(8 << 20):
                        h.update(chunk)
        return h.hexdigest()[:24]

    def describe_failure(self) -> str:
        """What the input looks like, for a run in which no row could be read."""
        looks = []
        for f in self.files[:3]:
            try:
                looks.append(f"{f.short} looks like {looks_like(self.head(f))}")
            except OSError:
                pass
        return "; ".join(looks)


