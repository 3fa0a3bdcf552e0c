"""The worker's capture hot path (vx/engine/capture.py, vx/engine/sink.py), on real tensors and a real ShardWriter.

The hidden-state cache is laid out as vLLM's cache-only group lays it: [blocks, L, block_size, H],
a request's rows at slots block_ids[i] * block_size + offset. Each test builds such a cache from
known per-sample states and checks what lands in the shards against those states directly.
"""

import threading
import time

import pytest
import torch

import vx
from vx.engine.capture import Finished, gather_rows, slots_of
from vx.engine.sink import CaptureSink
from vx.engine.pinned_ring import PinnedRing
from vx.store.writer import ShardWriter
from vx.store.encoding import FP8_MAX

L, H, BS = 3, 16, 4


def cache_with(samples: dict[str, torch.Tensor], num_blocks: int = 64, seed: int = 0):
    """Scatter each sample's [T, L, H] rows into shuffled blocks; returns the cache and Finished list."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, L, BS, H, generator=g).to(torch.bfloat16)  # garbage elsewhere
    free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # block 0 is vLLM's null block
    finished = []
    for i, (sid, h) in enumerate(samples.items()):
        blocks = [free.pop() for _ in range(-(-h.shape[0] // BS) + 1)]  # one spare block past the end
        for t in range(h.shape[0]):
            cache[blocks[t // BS], :, t % BS] = h[t]
        finished.append(Finished(f"req-{i}", sid, i + 1, bytes([1, 0] * h.shape[0])[: h.shape[0]],
                                 list(range(h.shape[0])), blocks))
    return cache, finished


def states(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, L, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_gather_returns_each_requests_rows_in_position_order():
    samples = {"a": states(1, 1), "b": states(9, 2), "c": states(4, 3)}
    cache, finished = cache_with(samples)
    rows = gather_rows(cache, slots_of(finished, BS))
    assert torch.equal(rows, torch.cat(list(samples.values())))


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_sink_writes_every_sample_and_rejects_bad_states(tmp_path, store):
    samples = {f"s{i}": states(t, i) for i, t in enumerate([1, 5, 12, 7, 3])}
    samples["nan"] = states(6, 9)
    samples["nan"][2, 1, 3] = float("nan")
    samples["zero-layer"] = states(5, 10)
    samples["zero-layer"][:, 2] = 0
    cache, finished = cache_with(samples)
    writer = ShardWriter(tmp_path, {"model": "t"}, 500, 0, L, H, store)
    sink = CaptureSink(writer, store, torch.device("cpu"))
    sink.submit(cache, finished[:3], BS)
    sink.submit(cache, finished[3:], BS)
    sink.close()
    ds = vx.open_dataset(tmp_path)
    good = [k for k in samples if k not in ("nan", "zero-layer")]
    assert sorted(ds.ids) == sorted(good)
    assert dict(writer.rejected) == {"nan": "hidden states contain NaN or Inf",
                                     "zero-layer": "layer positions [2] are all zero"}
    for f in finished:
        if f.sample_id in good:
            got, want = ds[f.sample_id]["hidden_states"].float(), samples[f.sample_id].float()
            assert ds[f.sample_id]["loss_mask"].tolist() == list(f.loss_mask)
            if store == "bf16":
                assert torch.equal(got, want)
            else:  # the fp8 bound of docs/output-format.md: per token and layer, |x - dequant(x)| <= amax / 16
                amax = want.abs().amax(dim=2, keepdim=True)
                assert ((got - want).abs() <= amax / 16 + 1e-6).all()
                assert (amax / FP8_MAX > 0).all()
    assert writer.committed_shards >= 2  # 500-byte shards: the samples span several


def test_ring_hands_out_fifo_slots_wraps_and_waits_for_release():
    ring = PinnedRing(1024, pin=False)
    a, ta = ring.alloc(400)
    b, tb = ring.alloc(400)
    assert b.data_ptr() - a.data_ptr() == 448  # 400 rounded up to the 64-byte alignment
    got = []

    def third():
        got.append(ring.alloc(400))  # does not fit until the first slot is released

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert not got and ring.waits >= 1
    ring.release(ta)
    t.join(timeout=300)
    c, tc = got[0]
    assert c.data_ptr() == a.data_ptr()  # wrapped to the start of the arena
    ring.release(tb)
    with pytest.raises(RuntimeError, match="released twice"):
        ring.release(tb)
    ring.release(tc)
    big, token = ring.alloc(4096)  # larger than the ring: a buffer of its own
    assert token is None and big.numel() >= 4096


def test_a_slot_released_early_is_reused_only_once_the_older_ones_are():
    """The writer releases slots as shards commit, the intake those it copied out at once: out of
    order. Space comes back from the oldest live slot on, so nothing live is ever handed out."""
    ring = PinnedRing(3 * 64, pin=False)
    (a, ta), (b, tb), (_c, tc) = ring.alloc(64), ring.alloc(64), ring.alloc(64)
    ring.release(tb)  # the middle one: still behind a
    asked = []
    got = []
    t = threading.Thread(target=lambda: got.append(ring.alloc(64, on_wait=lambda: asked.append(1))))
    t.start()
    time.sleep(0.2)
    assert not got and asked == [1]  # it waits, and said so once
    ring.release(ta)  # now a and b are free
    t.join(timeout=300)
    assert got[0][0].data_ptr() == a.data_ptr()
    d, td = ring.alloc(64)
    assert d.data_ptr() == b.data_ptr()
    for tok in (tc, got[0][1], td):
        ring.release(tok)


def test_views_of_one_slot_never_overlap():
    ring = PinnedRing(1 << 16, pin=False)
    slots = [ring.alloc(n) for n in (100, 64, 1, 300)]
    spans = sorted((s.data_ptr(), s.data_ptr() + s.numel()) for s, _ in slots)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def _peak_bytes(fn) -> int:
    """Peak bytes of tensors fn() asks torch's allocator for, alive at once (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_the_chunked_gather_never_holds_more_than_its_bound(store):
    """A group of 3,000 finished rows (one long sample's worth) gathered and encoded 100 rows at a
    time asks for at most 100 rows' bound at once; all at once it would ask for 30x that."""
    from vx.engine.capture import capture_chunks, device_row_bytes

    layers, hidden, bs = 5, 512, 16
    cache = torch.randn(200, layers, bs, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    slots = torch.randperm(200 * bs, generator=torch.Generator().manual_seed(1))[:3000]
    bound = 100 * device_row_bytes(layers, hidden, store)
    chunked = _peak_bytes(lambda: capture_chunks(cache, slots, store, 100, lambda *a: None))
    whole = _peak_bytes(lambda: capture_chunks(cache, slots, store, 3000, lambda *a: None))
    row = layers * hidden * (2 if store == "bf16" else 7)  # gathered bf16 (+ fp32 temporary + fp8 output)
    assert 100 * row <= chunked <= bound, (chunked, bound)
    assert whole >= 3000 * row > 20 * bound


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_shards_are_bit_identical_whatever_the_chunk_size(tmp_path, store):
    samples = {f"s{i}": states(t, i) for i, t in enumerate([1, 37, 12, 64, 3, 9])}
    cache, finished = cache_with(samples, num_blocks=128)
    files = {}
    for chunk in (7, 1, 10_000):
        out = tmp_path / f"chunk{chunk}"
        out.mkdir()
        writer = ShardWriter(out, {"model": "t"}, 4000, 0, L, H, store)
        sink = CaptureSink(writer, store, torch.device("cpu"), chunk_rows=chunk)
        sink.submit(cache, finished[:4], BS)
        sink.submit(cache, finished[4:], BS)
        sink.close()
        files[chunk] = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}
        files[chunk]["manifest"] = (out / "manifest.jsonl").read_bytes()
    assert len(files[7]) > 2 and files[7] == files[1] == files[10_000]
    # and the states are the cache's own rows (bf16: exactly)
    ds = vx.open_dataset(tmp_path / "chunk7")
    if store == "bf16":
        assert all(torch.equal(ds[k]["hidden_states"], v) for k, v in samples.items())


def test_fp8_encoding_is_the_same_division_as_before_without_a_second_fp32_copy():
    from vx.store.encoding import encode_on

    x = torch.randn(50, 4, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) * 30
    q, scales = encode_on(x, "fp8")
    amax = torch.maximum(x.float().amax(dim=2), x.float().amin(dim=2).neg())
    want = (x.to(torch.float32) / (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2))
    assert torch.equal(q.view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))
    y = torch.randn(6, 2, 8)  # an fp32 input is left as it was
    before = y.clone()
    encode_on(y, "fp8")
    assert torch.equal(y, before)


def test_the_ring_holds_three_full_steps_and_a_chunk_fits_the_side_stream_budget():
    """The issue's numbers: a 27B target (5 layers x 5,120) at vx's GPU step of 8,192 tokens."""
    from vx.engine.capture import DEVICE_BYTES, capture_budget, device_row_bytes

    for store, row in (("bf16", 5 * 5120 * 2), ("fp8", 5 * 5120 + 4 * 5)):
        b = capture_budget(8192, 5, 5120, store)
        assert b["ring_bytes"] >= 3 * 8192 * row  # bf16: 3 x 419 MB
        assert b["chunk_rows"] * device_row_bytes(5, 5120, store) <= DEVICE_BYTES
        assert b["chunk_rows"] >= 1000  # and still a few large gathers per step, not thousands
    assert 8192 * 5 * 5120 * 2 == 419_430_400  # one full bf16 step: the old 256 MiB ring held none
    small = capture_budget(64, 5, 256, "bf16")  # a step smaller than the budget is one chunk
    assert small["chunk_rows"] == 64


def _run_sink(out, samples, finished, store, shard_bytes, steps, **sink):
    writer = ShardWriter(out, {"model": "t"}, shard_bytes, 0, L, H, store)
    s = CaptureSink(writer, store, torch.device("cpu"), **sink)
    cache = samples
    for part in steps:
        s.submit(cache, [finished[i] for i in part], BS)
    s.close()
    return s, writer


STEPS = [[0, 1], [2], [3, 4, 5, 6], [7]]  # the requests finished in each engine step


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_the_ring_path_writes_shards_straight_from_the_ring_identical_to_the_copying_path(tmp_path, store):
    """The GPU's staging (here in pageable memory, without streams): the writer keeps views of the
    ring's slots and writes from them; with no room to hold slots it copies rows out instead. The
    shards are byte for byte those of the CPU's inline path, with the same samples rejected."""
    samples = {f"s{i}": states(t, i) for i, t in enumerate([1, 37, 12, 64, 3, 9, 20, 5])}
    samples["s2"][4, 0, 0] = float("inf")
    cache, finished = cache_with(samples, num_blocks=128)
    files, sinks = {}, {}
    runs = {"inline": dict(staging="inline"),
            "ring zero-copy": dict(staging="ring", ring_bytes=1 << 20, hold_bytes=1 << 19, chunk_rows=16),
            "ring copied": dict(staging="ring", ring_bytes=1 << 20, hold_bytes=0, chunk_rows=16)}
    for name, kw in runs.items():
        out = tmp_path / name.replace(" ", "-")
        out.mkdir()
        sinks[name], w = _run_sink(out, cache, finished, store, 3000 if store == "bf16" else 1500, STEPS, **kw)
        assert dict(w.rejected) == {"s2": "hidden states contain NaN or Inf"}
        files[name] = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}
        files[name]["manifest"] = (out / "manifest.jsonl").read_bytes()
    assert len(files["inline"]) > 3 and files["inline"] == files["ring zero-copy"] == files["ring copied"]
    rows = sum(x.shape[0] for x in samples.values())
    assert sinks["ring zero-copy"].zero_copy_rows == rows and sinks["ring zero-copy"].copied_rows == 0
    assert sinks["ring copied"].copied_rows == rows and sinks["ring copied"].zero_copy_rows == 0
    if store == "bf16":
        ds = vx.open_dataset(tmp_path / "ring-zero-copy")
        assert all(torch.equal(ds[k]["hidden_states"], v) for k, v in samples.items() if k != "s2")


def test_a_ring_smaller_than_a_shard_commits_smaller_shards_instead_of_waiting_forever(tmp_path):
    """The open shard holds the ring's oldest slots and would only be written once full, which it
    cannot get without new slots: the forward, waiting for room, has the writer commit it now."""
    samples = {f"s{i}": states(t, i) for i, t in enumerate([30, 30, 30, 30, 30, 30, 30, 30])}
    cache, finished = cache_with(samples, num_blocks=128)
    row = L * H * 2 + 1 + L
    done = []
    t = threading.Thread(target=lambda: done.append(_run_sink(
        tmp_path, cache, finished, "bf16", 1 << 30, [[i] for i in range(8)], staging="ring",
        ring_bytes=4 * 32 * row, hold_bytes=3 * 32 * row, chunk_rows=32)))
    t.start()
    t.join(timeout=300)
    assert done, "the capture waited for ring space that only its own open shard held"
    sink, writer = done[0]
    ds = vx.open_dataset(tmp_path)
    assert sorted(ds.ids) == sorted(samples) and writer.committed_shards >= 2  # 1 GB asked: flushed
    assert all(torch.equal(ds[k]["hidden_states"], v) for k, v in samples.items())
    assert sink.zero_copy_rows >= 3 * 30 and sink.ring_waits >= 1  # it held slots, and waited


def test_the_ring_gives_the_writer_a_full_shard_beside_three_steps_in_flight():
    """A 27B target (5 x 5,120), an 8k-token step, 1 GB shards: torch pins a power of two, so the
    ring is 4 GiB, and the writer's share holds a whole shard."""
    from vx.engine.capture import RING_STEPS, capture_budget, store_row_bytes

    b = capture_budget(8192, 5, 5120, "bf16", shard_bytes=1 << 30)
    assert b["ring_bytes"] == 4 << 30
    assert b["ring_bytes"] - b["hold_bytes"] >= RING_STEPS * 8192 * store_row_bytes(5, 5120, "bf16")
    assert b["hold_bytes"] >= (1 << 30) * 1.05
    huge = capture_budget(8192, 5, 5120, "bf16", shard_bytes=16 << 30)  # a writer's share past the cap
    assert huge["ring_bytes"] == 4 << 30 and huge["hold_bytes"] < 16 << 30
