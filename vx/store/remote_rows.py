"""Rows of an S3 output read in place, by ranged GETs: a sample's states, scales and ids are each
one contiguous span of its shard, so a row costs two or three GETs of exactly its bytes (coded
states, --compress blocks: of the blocks that hold them), and no local disk. A shard's sha256 only checks a whole shard, so each row is checked against its own
digest (`row_digest`), made when the output was indexed from a shard that passed its sha256.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import torch

from vx.errors import VxError
from vx.store.s3_client import S3Target, make_client, parse_s3_url
from vx.store import blocks
from vx.store.encoding import decode
from vx.store.reader import tensor_at

ROW_TENSORS = ("hidden_states", "hidden_scales", "input_ids")


def row_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over a row's hidden_states, hidden_scales (fp8 only) and input_ids bytes, in that order."""
    h = hashlib.sha256()
    for name in ROW_TENSORS:
        if name in tensors:
            h.update(tensors[name].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


class RemoteRows:
    """`get(shard, a, b, digest)` -> {"hidden_states" [T, L, H] (fp8 dequantized), "input_ids" [T]},
    rows a..b of a shard under the output at `url`, or None when they do not match `digest`."""

    HEADERS = 1024  # shard headers kept (a few KB each)

    def __init__(self, url: str, endpoint_url: str | None):
        self.target: S3Target = parse_s3_url(url)
        self.client = make_client(endpoint_url)
        self._headers: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self.bytes_read = 0

    def _get(self, shard: str, a: int, b: int) -> bytearray:
        """Bytes a..b-1 of a shard; fewer when the object is shorter (not the shard that was indexed)."""
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.target.bucket, Key=self.target.key(shard),
                                          Range=f"bytes={a}-{b - 1}")["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "InvalidRange":
                raise
            body = b""
        self.bytes_read += len(body)
        return bytearray(body)

    def header(self, shard: str) -> tuple[dict, int] | None:
        if shard not in self._headers:
            head = self._get(shard, 0, 8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            try:
                entries = blocks.entries(json.loads(bytes(self._get(shard, 8, 8 + n)))) if 0 < n < 100 << 20 else None
            except (ValueError, KeyError, TypeError, AttributeError):
                entries = None
            if not isinstance(entries, dict) or "hidden_states" not in entries:
                return None  # not a shard any more: its rows fail their digests
            self._headers[shard] = entries, 8 + n
            while len(self._headers) > self.HEADERS:
                self._headers.popitem(last=False)
        self._headers.move_to_end(shard)
        return self._headers[shard]

    def tensors(self, shard: str, names) -> dict | None:
        """Whole uncoded tensors of a shard (its offsets, ids or masks: a few bytes per token), one GET
        each; None when the shard's header is unreadable or a tensor is short."""
        header = self.header(shard)
        if header is None:
            return None
        entries, base = header
        got = {}
        for name in names:
            e = entries[name]
            a, b = base + e["data_offsets"][0], base + e["data_offsets"][1]
            body = self._get(shard, a, b) if b > a else bytearray()
            if len(body) != b - a:
                return None
            got[name] = tensor_at(body, 0, dict(e, data_offsets=[0, b - a]))
        return got

    def get(self, shard: str, a: int, b: int, digest: str) -> dict | None:
        if shard.endswith(".zst"):
            raise VxError(f"{shard}: a compressed shard has no byte ranges per row; read it through the cache")
        header = self.header(shard)
        if header is None:
            return None
        entries, base = header
        got = {}
        for name in ROW_TENSORS:
            if name not in entries:
                continue
            e = entries[name]
            start = base + e["data_offsets"][0]
            if "coded" in e:  # --compress blocks: one GET of the blocks that hold the rows
                try:
                    got[name] = blocks.read_rows(e, a, b, lambda lo, hi: self._get(shard, start + lo, start + hi))
                except Exception:  # noqa: BLE001 - short or changed bytes: not the rows that were indexed
                    return None
                continue
            row = e["data_offsets"][1] - e["data_offsets"][0]
            row //= max(1, e["shape"][0])
            body = self._get(shard, start + a * row, start + b * row) if b > a else bytearray()
            if len(body) != (b - a) * row:
                return None
            got[name] = tensor_at(body, 0, dict(e, shape=[b - a, *e["shape"][1:]], data_offsets=[0, (b - a) * row]))
        if row_digest(got) != digest:
            return None
        return {"hidden_states": decode(got["hidden_states"], got.get("hidden_scales")), "input_ids": got["input_ids"]}
