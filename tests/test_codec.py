"""The codecs `vx inspect --codecs` measures give back every byte they were given, whatever the
bytes: random ones, bf16 specials (NaN, infinities, -0, subnormals), and state-like rows, where
the exponent-plane codec must also beat plain zstd."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from vx.store.codec import BlockCodec, codecs, measure


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=1 << 14).map(lambda b: b[: len(b) // 2 * 2]))
def test_every_codec_gives_back_any_even_run_of_bytes(data):
    for itemsize in (2, 1):
        for name, (enc, dec) in codecs(itemsize).items():
            assert bytes(dec(enc(data), len(data))) == data, (itemsize, name)


def test_bf16_specials_survive_the_plane_split():
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-40, 3.0e38, 1.0],
                            dtype=torch.bfloat16)
    data = specials.repeat(1000).view(torch.uint8).numpy().tobytes()
    planes, back = BlockCodec(2), np.empty(len(data), np.uint8)
    planes.decode(b"".join(bytes(x) for x in planes.encode([np.frombuffer(data, np.uint8)])), back)
    back = torch.from_numpy(back).view(torch.bfloat16)
    assert back.view(torch.int16).tolist() == specials.repeat(1000).view(torch.int16).tolist()


def test_state_like_rows_code_smaller_by_planes_than_by_plain_zstd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 5, 256, generator=g) * torch.rand(1, 1, 256, generator=g).exp()
    x[:, :, 7] *= 300.0  # an outlier channel
    raw = x.to(torch.bfloat16).view(torch.uint8).reshape(-1).numpy().tobytes()
    blocks = [raw[i:i + (1 << 20)] for i in range(0, len(raw), 1 << 20)]
    rows = {r["codec"]: r for r in measure(blocks, 2)}
    assert all(r["lossless"] for r in rows.values())
    coded = sum(memoryview(x).nbytes for b in blocks for x in BlockCodec(2).encode([np.frombuffer(b, np.uint8)]))
    assert rows["planes"]["ratio"] == round(len(raw) / coded, 3) > rows["zstd-1"]["ratio"] > 1.0
    fp8 = {r["codec"] for r in measure([np.zeros(4096, np.uint8).tobytes()], 1)}
    assert "planes" not in fp8 and "zstd-1" in fp8  # one-byte values have no planes to split
