"""Input file formats: sniffed from a file's first bytes (gzip, zstd, parquet, Arrow IPC stream or
file, else JSONL), decompressed as a stream, and read as (row number, record, problem) triples."""

from __future__ import annotations

import io
import json
from typing import Iterator


class BadRecord(Exception):
    """A row that is not a usable record; the message is the reason written to errors.jsonl."""


GZIP, ZSTD, PARQUET, ARROW_STREAM, ARROW_FILE, TEXT = "gzip", "zstd", "parquet", "arrow", "arrow-file", "jsonl"
SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz", ".jsonl.zst", ".json.zst",
            ".ndjson.zst", ".parquet", ".arrow")


ROW_BATCH = 256  # parquet/arrow rows decoded to Python at a time


def sniff(head: bytes) -> str:
    if head[:2] == b"\x1f\x8b":
        return GZIP
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return ZSTD
    if head[:4] == b"PAR1":
        return PARQUET
    if head[:6] == b"ARROW1":
        return ARROW_FILE
    if head[:4] == b"\xff\xff\xff\xff":
        return ARROW_STREAM
    return TEXT


def looks_like(head: bytes) -> str:
    """What a file whose rows were all bad looks like, for the one-line error."""
    kind = sniff(head)
    if kind != TEXT:
        return f"{kind} data"
    text = head.lstrip()
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(text) - 4:  # not just a multi-byte character cut by the sniff window
            return "binary data, not JSONL/gzip/zstd/parquet/arrow"
    if text.startswith(b"["):
        return "one JSON array, not JSON lines (one object per line)"
    first = text.split(b"\n", 1)[0]
    if first.startswith(b"{"):
        return "JSON lines"
    if b"," in first or b"\t" in first:
        return "CSV/TSV text, not JSON lines"
    return "plain text, not JSON lines"


def supported(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


class BodyReader(io.RawIOBase):
    """A botocore StreamingBody as a raw stream, so it can be buffered, peeked and decompressed."""

    def __init__(self, body):
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.body.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.body.close()
        super().close()


def decompressed(raw, kind: str):
    if kind in (GZIP, ZSTD):
        return io.BufferedReader(_Inflate(raw, kind), buffer_size=1 << 20)
    return raw


class _Inflate(io.RawIOBase):
    """A gzip or zstd stream (any number of members/frames), decompressed as its bytes arrive: a
    file cut short yields every byte before the cut, then EOFError (json_lines makes that a bad
    line). gzip.GzipFile would lose up to a buffer's worth before raising."""

    def __init__(self, raw, kind: str):
        self.raw, self.kind = raw, kind
        self.d = self._member()
        self.out, self.at = memoryview(b""), 0  # decompressed bytes not yet handed out, from `at`
        self.in_member = False  # bytes of a member/frame read and its end not reached yet

    def _member(self):
        if self.kind == GZIP:
            import zlib

            return zlib.decompressobj(wbits=31)
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self.at == len(self.out):
            data = self.d.unused_data or self.raw.read(1 << 16)
            if self.d.unused_data:  # the next gzip member or zstd frame
                self.d = self._member()
            if not data:
                if self.in_member:
                    raise EOFError("compressed file ended before the end-of-stream marker was reached")
                return 0
            self.in_member = True
            try:
                self.out, self.at = memoryview(self.d.decompress(data)), 0
            except Exception as e:  # zlib.error / zstandard.ZstdError: corrupt bytes
                raise OSError(f"corrupt {self.kind} data: {e}") from None
            if self.d.eof and not self.d.unused_data:
                self.in_member = False
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n


def json_lines(stream) -> Iterator[tuple[int, dict | None, str | None]]:
    lineno = 0
    try:
        for lineno, raw in enumerate(stream, start=1):
            if not raw.strip():
                yield lineno, None, None
                continue
            try:
                yield lineno, parse_line(raw), None
            except BadRecord as e:
                yield lineno, None, str(e)
    except (OSError, EOFError) as e:  # a truncated or corrupt compressed stream: a bad line where it broke
        yield lineno + 1, None, (f"the compressed file is cut short or corrupt after line {lineno} ({e}): "
                                 "the lines before are read; fetch the file again for the rest")


def count_lines(stream) -> int:
    """Non-blank lines, as json_lines yields them (a cut-short compressed stream: one more, the cut)."""
    n = 0
    try:
        for raw in stream:
            n += bool(raw.strip())
    except (OSError, EOFError):
        n += 1
    return n


def parse_line(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"line is not valid UTF-8 (byte {e.start})") from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(rec, dict):
        raise BadRecord("line is not a JSON object")
    return rec


def table_rows(source, kind: str) -> Iterator[tuple[int, dict, None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == PARQUET:
        batches = pq.ParquetFile(source).iter_batches(batch_size=ROW_BATCH)
    elif kind == ARROW_FILE:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = pa.ipc.open_stream(source)
    row = 0
    for batch in batches:
        for start in range(0, batch.num_rows, ROW_BATCH):
            for rec in batch.slice(start, ROW_BATCH).to_pylist():
                row += 1
                yield row, rec, None
