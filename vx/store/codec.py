"""Lossless codecs for stored states, and their measurement on a user's own shards
(`vx inspect OUTPUT --codecs`; bench/codec.py holds the same codecs to account on set data).

Each codec codes one block of bytes (~1 MiB of rows) on its own: encode(bytes) -> bytes,
decode(bytes, n) -> bytes. Shards do not use them yet; this is how a user sees what each would save
on their own states before it does.
  zstd-1       the whole block; what `--compress zstd` does to a shard
  planes       2-byte dtypes: the high bytes (sign + 7 exponent bits, ~2.5-3 bits of entropy)
               entropy-coded by zstd's fast strategy, the low bytes (1 exponent bit + 7 mantissa
               bits, ~8 of 8) stored raw. numpy's strided copies and zstandard release the GIL.
  zipnn, blosc2  where installed (`pip install zipnn blosc2`): both hold the GIL while they code
"""

from __future__ import annotations

import time

import numpy as np

BLOCK = 1 << 20


def _zstd_fast():
    import zstandard

    # long minimum matches and a small hash table: zstd-1's match finder spends most of its time on
    # a plane's many short repeats for no gain (bench/codec.py: 0.33 against 0.75 GB/s of plane)
    params = zstandard.ZstdCompressionParameters(window_log=17, hash_log=10, chain_log=10, search_log=1, min_match=7,
                                                 target_length=0, strategy=zstandard.STRATEGY_FAST)
    return zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()


def planes_codec():
    c, d = _zstd_fast()

    def encode(b: bytes) -> bytes:
        a = np.frombuffer(b, dtype=np.uint8)  # [2n]: low, high, low, high, ...
        hi = c.compress(np.ascontiguousarray(a[1::2]).data)
        return len(hi).to_bytes(8, "little") + hi + np.ascontiguousarray(a[0::2]).tobytes()

    def decode(b: bytes, n: int) -> bytes:
        k = int.from_bytes(b[:8], "little")
        out = np.empty(n, dtype=np.uint8)
        out[1::2] = np.frombuffer(d.decompress(b[8:8 + k], max_output_size=n // 2), dtype=np.uint8)
        out[0::2] = np.frombuffer(b, dtype=np.uint8, offset=8 + k)
        return out.tobytes()

    return encode, decode


def codecs(itemsize: int) -> dict:
    """name -> (encode, decode) for stored values of `itemsize` bytes (2: bf16/fp16, 1: fp8)."""
    import zstandard

    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    out = {"zstd-1": (c.compress, lambda b, n: d.decompress(b, max_output_size=n))}
    if itemsize == 2:
        out["planes"] = planes_codec()
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


def measure(blocks: list[bytes], itemsize: int) -> list[dict]:
    """Each codec over the blocks on this thread: ratio, encode and decode GB/s of the uncoded
    bytes, and whether every block came back byte for byte."""
    n = sum(map(len, blocks))
    rows = []
    for name, (enc, dec) in codecs(itemsize).items():
        t = time.perf_counter()
        coded = [enc(b) for b in blocks]
        t_enc = time.perf_counter() - t
        t = time.perf_counter()
        back = [dec(c, len(b)) for c, b in zip(coded, blocks)]
        t_dec = time.perf_counter() - t
        rows.append({"codec": name, "ratio": round(n / max(1, sum(map(len, coded))), 3),
                     "encode_gb_s": round(n / max(t_enc, 1e-9) / 1e9, 3),
                     "decode_gb_s": round(n / max(t_dec, 1e-9) / 1e9, 3),
                     "lossless": all(bytes(x) == b for x, b in zip(back, blocks))})
    return rows
