"""Lossless codecs for stored states, and their measurement on a user's own shards
(`vx inspect OUTPUT --codecs`; bench/codec.py holds the same codecs to account on set data).

Each codec codes one block of bytes (~1 MiB of rows) on its own: encode(bytes) -> bytes,
decode(bytes, n) -> bytes.
  zstd-1       the whole block; what `--compress zstd` does to a shard
  planes       2-byte dtypes: the high bytes (sign + 7 exponent bits, ~2.5-3 bits of entropy)
               entropy-coded by zstd's fast strategy, the low bytes (1 exponent bit + 7 mantissa
               bits, ~8 of 8) stored raw; split by a shift and a narrowing cast. numpy's ufuncs
               and zstandard release the GIL.
  zipnn, blosc2  where installed (`pip install zipnn blosc2`): both hold the GIL while they code
`BlockCodec` is what shards use (`--compress blocks`, vx/store/blocks.py): planes for 2-byte
dtypes, zstd-1 for fp8, both GIL-free, coding from a block's pieces in place and
decoding into the reader's buffer.
"""

from __future__ import annotations

import threading
import time

import numpy as np

BLOCK = 1 << 20


def _zstd_fast():
    import zstandard

    # long minimum matches and the smallest hash table: on a plane of ~20 distinct bytes, zstd-1's
    # match finder spends most of its time on short, useless repeats (bench/codec.py: 0.33 against
    # 0.75 GB/s of plane), and a larger table only adds cache misses (64 entries: 2x faster than 1,024
    # on N(0, 3) states, and as small)
    params = zstandard.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                                 target_length=0, strategy=zstandard.STRATEGY_FAST)
    return zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()


class BlockCodec:
    """The shard codec of one store dtype: encode(pieces) -> buffers, decode(coded, out).
    Thread-safe: each thread gets its own zstd contexts (a context is not)."""

    def __init__(self, itemsize: int):
        if itemsize not in (1, 2):
            raise ValueError(f"blocks code 1- and 2-byte store dtypes, not {itemsize}-byte ones")
        self.name = "planes" if itemsize == 2 else "zstd-1"
        self._local = threading.local()

    def _ctx(self):
        if not hasattr(self._local, "c"):
            import zstandard

            # fp8: zstd-1 over the block (as small as zstd's fast strategy and 10-15% faster, measured)
            self._local.c, self._local.d = _zstd_fast() if self.name == "planes" else \
                (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor())
        return self._local.c, self._local.d

    def encode(self, pieces: list[np.ndarray]) -> list:
        """One block given as uint8 pieces (whole rows, in order) -> its coded bytes, as buffers
        to write one after the other."""
        c, _ = self._ctx()
        n = sum(len(p) for p in pieces)
        if self.name == "zstd-1":
            z = c.compressobj(size=n)
            return [b"".join([z.compress(p.data) for p in pieces] + [z.flush()])]
        hi = self._scratch(n // 2)  # this thread's, reused: only what is returned is new memory
        lo, at = np.empty(n // 2, np.uint8), 0
        for p in pieces:  # little-endian 2-byte values: low, high, low, high, ...
            u = p.view(np.uint16)  # a shift and a narrowing cast: ~3x numpy's strided copies
            np.right_shift(u, 8, out=hi[at:at + len(u)], casting="unsafe")
            np.copyto(lo[at:at + len(u)], u, casting="unsafe")
            at += len(u)
        h = c.compress(hi.data)
        return [len(h).to_bytes(8, "little") + h, lo]

    def _scratch(self, n: int) -> np.ndarray:
        if getattr(self._local, "scratch", None) is None or len(self._local.scratch) < n:
            self._local.scratch = np.empty(n, np.uint8)
        return self._local.scratch[:n]

    def decode(self, coded, out: np.ndarray) -> None:
        """A block's coded bytes -> `out` (uint8, the block's size), in place."""
        _, d = self._ctx()
        coded, n = memoryview(coded).cast("B"), len(out)
        if self.name == "zstd-1":
            out[:] = np.frombuffer(d.decompress(coded, max_output_size=n), np.uint8)
            return
        k = int.from_bytes(coded[:8], "little")
        hi = np.frombuffer(d.decompress(coded[8:8 + k], max_output_size=n // 2), np.uint8)
        u = out.view(np.uint16)  # (hi << 8) | lo: ~2x numpy's strided copies into out[1::2], out[0::2]
        np.left_shift(hi, 8, out=u, dtype=np.uint16)
        np.bitwise_or(u, np.frombuffer(coded, np.uint8, count=n // 2, offset=8 + k), out=u)


def codecs(itemsize: int) -> dict:
    """name -> (encode, decode) for stored values of `itemsize` bytes (2: bf16/fp16, 1: fp8)."""
    import zstandard

    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    out = {"zstd-1": (c.compress, lambda b, n: d.decompress(b, max_output_size=n))}
    ours = BlockCodec(itemsize)  # what --compress blocks does: "planes" (2 bytes), or zstd-1 as above (fp8)
    out[ours.name] = (lambda b: ours.encode([np.frombuffer(b, np.uint8)]), _into(ours.decode))
    if itemsize == 2:
        try:
            from zipnn import ZipNN

            z = ZipNN(bytearray_dtype="bfloat16", threads=1, input_format="byte")
            # zipnn 0.5.4 reorders its input in place, even an immutable `bytes`: it codes a copy
            out["zipnn"] = (lambda b: z.compress(bytearray(b)), lambda b, n: bytes(z.decompress(b)))
        except ImportError:
            pass
    try:
        import blosc2

        params = {"typesize": itemsize, "clevel": 1, "codec": blosc2.Codec.ZSTD, "nthreads": 1,
                  "filters": [blosc2.Filter.SHUFFLE], "filters_meta": [0]}
        out["blosc2 shuffle+zstd-1"] = (lambda b: blosc2.compress2(b, **params), lambda b, n: blosc2.decompress2(b))
    except ImportError:
        pass
    return out


def _into(decode):
    def dec(coded, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        decode(joined(coded), out)
        return out

    return dec


def joined(coded) -> bytes:
    """A codec's output as one buffer (ours gives its parts, written one after the other)."""
    return b"".join(bytes(memoryview(x).cast("B")) for x in coded) if isinstance(coded, list) else coded


def measure(blocks: list[bytes], itemsize: int) -> list[dict]:
    """Each codec over the blocks on this thread: ratio, encode and decode GB/s of the uncoded
    bytes, and whether every block came back byte for byte."""
    n = sum(map(len, blocks))
    rows = []
    for name, (enc, dec) in codecs(itemsize).items():
        t = time.perf_counter()
        coded = [enc(b) for b in blocks]
        t_enc = time.perf_counter() - t
        coded = [joined(c) for c in coded]  # as a reader gets them: one range of the file
        t = time.perf_counter()
        back = [dec(c, len(b)) for c, b in zip(coded, blocks)]
        t_dec = time.perf_counter() - t
        rows.append({"codec": name, "ratio": round(n / max(1, sum(map(len, coded))), 3),
                     "encode_gb_s": round(n / max(t_enc, 1e-9) / 1e9, 3),
                     "decode_gb_s": round(n / max(t_dec, 1e-9) / 1e9, 3),
                     "lossless": all(bytes(memoryview(x).cast("B")) == bytes(b) for x, b in zip(back, blocks))})
    return rows
