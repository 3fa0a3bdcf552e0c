"""The capture's pinned ring (vx/engine/pinned_ring.py) as a specification: a slot it hands out
never overlaps a slot still held, a ring without room waits, and a release wakes the waiter.

The ring's slots are where the device-to-host copies land and where the shard writer reads from:
a slot handed out twice is the silent kind of corruption (the shard's checksum is taken over the
overwritten bytes). The model below knows only what the ring promised its users: spans held,
released in any order, space reused from the oldest held slot on.
"""

import json
import os
import queue
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vx
from vx.engine.pinned_ring import ALIGN, PinnedRing


class _WouldWait(Exception):
    pass


def _would_wait():
    raise _WouldWait


def try_take(ring: PinnedRing, n: int):
    """ring.alloc that raises _WouldWait instead of waiting (on_wait runs before any wait)."""
    buf, token = ring.alloc(n, on_wait=_would_wait)
    return buf, token


def span(ring: PinnedRing, buf: torch.Tensor) -> tuple[int, int]:
    start = buf.data_ptr() - ring.arena.data_ptr()
    return start, start + buf.numel()


def test_a_ring_filled_exactly_by_a_wrap_hands_out_no_live_slot():
    """Uniform slots, the common case (full engine steps are the same size): 4 slots fill the
    ring, the first is released, the fifth wraps to 0 and fills it exactly; the sixth must wait,
    not get the second slot's live bytes."""
    s = 4 * ALIGN
    ring = PinnedRing(4 * s, pin=False)
    slots = [ring.alloc(s) for _ in range(4)]
    ring.release(slots[0][1])
    fifth, _ = ring.alloc(s)
    assert span(ring, fifth) == (0, s)
    with pytest.raises(_WouldWait):
        try_take(ring, s)  # today's code returned bytes s..2s: the second slot, still live


class RingMachine(RuleBasedStateMachine):
    """Random slot sizes (or one size for all, as full steps are), released in random order."""

    @initialize(slots=st.integers(1, 12), uniform=st.booleans(), slot=st.integers(1, 5 * ALIGN))
    def setup(self, slots, uniform, slot):
        self.capacity = slots * ALIGN * 3
        self.ring = PinnedRing(self.capacity, pin=False)
        self.uniform, self.slot = uniform, slot
        self.order: list[list] = []  # [start, end, token, released] in allocation order
        self.largest = 0

    def _held(self):
        return [e for e in self.order if not e[3]]

    def _fifo_live_bytes(self) -> int:
        """Bytes the ring may keep: every slot from the oldest still held on (a slot released
        early frees its bytes only once the older ones are released too)."""
        while self.order and self.order[0][3]:
            self.order.pop(0)
        return sum(e[1] - e[0] for e in self.order)

    @rule(size=st.integers(1, 5 * ALIGN))
    def take(self, size):
        n = self.slot if self.uniform else size
        padded = -(-n // ALIGN) * ALIGN
        if padded > self.capacity:
            buf, token = self.ring.alloc(n)
            assert token is None and buf.numel() >= n  # a buffer of its own, outside the arena
            return
        self.largest = max(self.largest, padded)
        held = self._held()
        try:
            buf, token = try_take(self.ring, n)
        except _WouldWait:
            assert held, "an empty ring made a request wait"
            free = self.capacity - self._fifo_live_bytes()
            assert free < padded + self.largest, f"waited with {free} of {self.capacity} bytes free for {padded}"
            return
        start, end = span(self.ring, buf)
        assert 0 <= start and end <= self.capacity and end - start >= n
        for s, e, _, _ in held:
            assert end <= s or e <= start, f"slot [{start}, {end}) overlaps live slot [{s}, {e})"
        assert sum(e - s for s, e, _, _ in held) + (end - start) <= self.capacity
        self.order.append([start, end, token, False])

    @precondition(lambda self: any(not e[3] for e in self.order))
    @rule(pick=st.integers(0, 1 << 30))
    def release(self, pick):
        held = self._held()
        entry = held[pick % len(held)]
        self.ring.release(entry[2])
        entry[3] = True

    @invariant()
    def full_ring_waits(self):
        if getattr(self, "ring", None) is None:
            return
        held = sum(e[1] - e[0] for e in self._held())
        if self.capacity - held < ALIGN:  # not one aligned byte free: every request must wait
            with pytest.raises(_WouldWait):
                try_take(self.ring, 1)


RingMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_ring_never_hands_out_a_live_slot = RingMachine.TestCase


@pytest.mark.parametrize("seed", range(4))
def test_threads_never_see_their_slots_overwritten(seed):
    """A producer (the forward) fills slots with its own mark; two consumers (the intake and the
    writer) check each slot's bytes after a random delay and release it, out of order. A slot
    handed out while live shows up as a wrong mark."""
    rng = random.Random(seed)
    uniform = seed % 2 == 0
    ring = PinnedRing(8 * 256, pin=False)
    todo: queue.Queue = queue.Queue()
    bad, checked = [], []

    def consume(r: random.Random):
        while (item := todo.get()) is not None:
            buf, token, mark = item
            if r.random() < 0.3:
                threading.Event().wait(r.random() * 0.002)
            if not bool((buf == mark).all()):
                bad.append(mark)
            checked.append(mark)
            try:
                ring.release(token)
            except RuntimeError as e:  # a token handed out twice: its second release
                bad.append(str(e))

    consumers = [threading.Thread(target=consume, args=(random.Random(seed * 10 + i),)) for i in range(2)]
    def produce():
        for i in range(3000):
            n = 256 if uniform else rng.randint(1, 700)
            buf, token = ring.alloc(n)
            mark = i % 251
            buf.fill_(mark)
            todo.put((buf[:n], token, mark))
        for _ in consumers:
            todo.put(None)

    producer = threading.Thread(target=produce, daemon=True)
    for t in [*consumers, producer]:
        t.daemon = True
        t.start()
    while producer.is_alive() and not bad:  # a lost slot can leave the producer waiting for ever
        producer.join(timeout=1)
    for t in consumers:
        t.join(timeout=600 if not bad else 1)
    assert len(checked) == 3000 and not bad, f"{len(bad)} slots were overwritten while live"
    assert ring.waits > 0  # the consumers fell behind: the ring was full and waited


def test_a_release_wakes_a_waiting_request():
    ring = PinnedRing(2 * ALIGN, pin=False)
    (_, ta), (_, tb) = ring.alloc(ALIGN), ring.alloc(ALIGN)
    waiting, done = threading.Event(), threading.Event()
    got = []

    def take():
        got.append(ring.alloc(ALIGN, on_wait=waiting.set))
        done.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    assert waiting.wait(600)  # it found no room
    assert not done.is_set()
    ring.release(tb)  # the newer slot: the oldest still holds the ring
    assert not done.wait(0.2)
    ring.release(ta)
    assert done.wait(600), "a release did not wake the waiting request"
    assert span(ring, got[0][0]) == (0, ALIGN)


# A CPU extraction through the ring path (staging="ring") with uniform steps, a ring of about three
# steps, one step per shard, and the writer stalled in the middle of its second shard: the forward
# fills the ring and wraps while the writer still reads the second step's slot.
_RUN = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from vx.engine.capture import Finished
    from vx.engine.sink import CaptureSink
    from vx.engine.pinned_ring import nbytes
    from vx.store.writer import ShardWriter
    L, H, BS, T, STEPS, PER_STEP = 3, 64, 4, 24, 12, 2
    out = Path(sys.argv[1]); out.mkdir(parents=True)
    chunk_rows = int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    blocks = PER_STEP * (T // BS)
    cache = torch.empty(blocks + 1, L, BS, H, dtype=torch.bfloat16)
    step_rows = PER_STEP * T
    step_bytes = nbytes([((step_rows, L, H), torch.bfloat16), ((step_rows,), torch.bool), ((step_rows, L), torch.bool)])
    token_bytes = L * H * 2 + 5
    writer = ShardWriter(out, {"model": "t"}, step_rows * token_bytes, 0, L, H, "bf16")
    sink = CaptureSink(writer, "bf16", torch.device("cpu"), ring_bytes=3 * step_bytes + 64,
                       chunk_rows=chunk_rows, hold_bytes=1 << 40, staging="ring")
    longest = 0.0
    for step in range(STEPS):
        cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))  # the next step's rows
        fin = []
        for j in range(PER_STEP):
            ids = list(range(1 + j * (T // BS), 1 + (j + 1) * (T // BS)))
            fin.append(Finished(f"r{step}-{j}", f"s{step}-{j}", step * PER_STEP + j, bytes([1]) * T, list(range(T)), ids))
        t = time.monotonic()
        sink.submit(cache, fin, BS)
        longest = max(longest, time.monotonic() - t)
    sink.close()
    print("ring waits", sink.ring_waits, "spills", sink.ring_spills, "longest submit", longest)
""")


def _run(out: Path, stall: bool, stall_s: int = 3, chunk_rows: int = 1 << 20, **extra) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VX_FAULT", "VLLM_EXECUTE_MODEL"))}
    env.update(extra)
    if stall:
        env.update(VX_FAULT="mid-shard-write:2:stall", VX_FAULT_STALL_S=str(stall_s))
    r = subprocess.run([sys.executable, "-c", _RUN, str(out), str(chunk_rows)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_stalled_writer_behind_a_full_ring_writes_the_same_bytes(tmp_path):
    """Shards written while the ring was full and the writer stalled are byte-identical to those
    of an unstalled run: backpressure waits, it never hands the forward a slot still being read."""
    calm, stalled = tmp_path / "calm", tmp_path / "stalled"
    _run(calm, stall=False)
    said = _run(stalled, stall=True)
    waits = int(said.split("ring waits ")[1].split()[0])
    assert waits > 0, said  # the ring did fill: the stall was felt
    shards = sorted(p.name for p in calm.glob("*.safetensors"))
    assert len(shards) >= 10 and shards == sorted(p.name for p in stalled.glob("*.safetensors"))
    for name in shards:
        assert (calm / name).read_bytes() == (stalled / name).read_bytes(), f"{name} differs"


def _said(out: str, what: str) -> float:
    return float(out.split(what + " ")[1].split()[0])


def test_backpressure_never_outwaits_vllms_execute_timeout(tmp_path):
    """With tensor parallelism vLLM declares a worker dead when a step outlasts
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (MultiprocExecutor). A writer stalled 10 s behind a full ring,
    against a 5 s timeout (a wait for the stall alone would outlast it): no step's capture waits
    past half of it (the step gets a buffer of its own instead), the run completes, and its shards
    are byte-identical to an unstalled run's. Each step is four chunks here (a GPU's long steps are
    several): the bound is the step's, not each chunk's, which would add up past the timeout."""
    calm, stalled = tmp_path / "calm", tmp_path / "stalled"
    _run(calm, stall=False)
    said = _run(stalled, stall=True, stall_s=10, chunk_rows=12, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="5")
    assert _said(said, "spills") > 0, said  # the bound was reached: steps went on without the ring
    assert _said(said, "longest submit") < 5, said  # under the timeout (the bound is 2.5 s)
    shards = sorted(p.name for p in calm.glob("*.safetensors"))
    assert shards == sorted(p.name for p in stalled.glob("*.safetensors"))
    for name in shards:
        assert (calm / name).read_bytes() == (stalled / name).read_bytes(), f"{name} differs"


def test_the_wait_bound_follows_the_execute_timeout_in_force():
    from vx.engine.capture import execute_wait_bound_s

    assert execute_wait_bound_s({}) == 150.0  # vLLM's default 300 s
    assert execute_wait_bound_s({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "5"}) == 2.5
    assert execute_wait_bound_s({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "junk"}) == 150.0


# A tensor-parallel engine (2 ranks; only rank 0 captures) staging through the ring, its writer
# stalled 18 s in its second shard while vLLM's execute timeout is 10 s.
_TP_RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from vx.data.samples import Sample
    from vx.engine.vllm_extractor import VllmExtractor
    model, out, data = sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    out.mkdir(parents=True)
    samples = [Sample(d["id"], d["line"], d["ids"], d["mask"]) for d in data]
    ex = VllmExtractor(model, list(range(8)), tensor_parallel_size=2, max_num_batched_tokens=256, max_num_seqs=8,
                       gpu_memory_utilization=0.1)
    try:
        stats = ex.run(samples, out, {"model": "test"}, 1 << 20, 0, 256, "bf16", staging="ring")
    finally:
        ex.close()
    print(json.dumps(stats))
""")


def test_a_tensor_parallel_engine_outlives_a_writer_stalled_past_vllms_execute_timeout(tiny_model, tmp_path):
    """vLLM's MultiprocExecutor gives each step VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS and then declares
    the workers dead. A TP=2 engine's writer stalls 18 s (a hung disk or a throttled S3 endpoint)
    against a 10 s timeout (the ring fills within the stall's first seconds, so a step that waited
    for the writer would outlast the timeout), with the ring far smaller than the data behind it:
    the forward waits for ring space at most 5 s a step and then goes on with buffers of its own,
    the run completes, every sample is stored once, and every row matches the HF reference. (10 s,
    not 5: in the suite both ranks, the engine core and the driver share one core, and a plain step
    once took more than 5 s there.)"""
    from test_vllm_backend import assert_matches, hf_reference, mixed_samples

    samples = mixed_samples(500, n=20, seed=13)  # 25 samples, 13,152 tokens, 54 MB of states: ~6x the ring
    data = tmp_path / "samples.json"
    data.write_text(json.dumps([{"id": s.id, "line": s.line, "ids": s.input_ids, "mask": s.loss_mask}
                                for s in samples]))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VX_FAULT", "VLLM_EXECUTE_MODEL"))}
    env.update(VX_FAULT="mid-shard-write:2:stall", VX_FAULT_STALL_S="18", VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="10")
    r = subprocess.run([sys.executable, "-c", _TP_RUN, str(tiny_model), str(out), str(data)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.splitlines()[-1])
    assert stats["ring_spills"] > 0, stats  # the ring filled behind the stalled writer: the bound was reached
    ds = vx.open_dataset(out)
    assert sorted(ds.ids) == sorted(s.id for s in samples)  # every sample, once
    assert_matches(ds, samples, hf_reference(tiny_model, samples, list(range(8))))
