"""The shard writer: packs samples into shards and commits them (format: vx/store/format.py).

`add()` only appends to the open shard; a full shard is handed to the writer thread, which
checks, encodes, writes, fsyncs, renames and appends the manifest line (the commit). The process
whose writer writes a directory holds its writer lock.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vx import faults
from vx.errors import VxError
from vx.store.checksum import ALGO
from vx.store.encoding import SampleRejected, bytes_per_token, check_states, encode
from vx.store.format import (
    MANIFEST,
    SHARD_FORMAT,
    fsync_dir,
    shard_name,
    write_safetensors,
)
from vx.store.lock import WRITER_LOCK, try_lock

CODEC_THREADS = 2  # per writer (one per engine): ~0.9-1.5 GB/s of bf16 states coded here (docs/performance.md)


def _pieces(x) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]


def _rows_shape(x) -> tuple[int, ...]:
    """The shape of a tensor, or of its rows given in pieces ([t_i, ...] each)."""
    if not isinstance(x, list):
        return tuple(x.shape)
    if not x:
        return (0,)
    return (sum(p.shape[0] for p in x), *x[0].shape[1:])


@dataclass
class PendingShard:
    index: int
    ids: list[str] = field(default_factory=list)
    lines: list[int | None] = field(default_factory=list)  # dataset lines, for rejections
    hidden: list = field(default_factory=list)  # per sample: [T, L, H], or its rows in pieces
    scales: list = field(default_factory=list)  # fp8: [T, L] (or pieces) per sample, else None
    encoded: list[bool] = field(default_factory=list)  # checked and in the store dtype already
    input_ids: list[torch.Tensor] = field(default_factory=list)
    loss_mask: list[torch.Tensor] = field(default_factory=list)
    holds: list = field(default_factory=list)  # what the pieces are views of: dropped once written
    tokens: int = 0
    nbytes: int = 0

    def drop_holds(self) -> None:
        holds, self.holds = self.holds, []
        for h in holds:
            h.drop()


class ShardWriter:
    """Packs samples into shards and commits them from a background thread.

    `add()` only appends to the open shard; a full shard is handed to the writer thread through
    a queue of depth 1, so file I/O overlaps compute and at most two shards sit in memory.
    """

    def __init__(self, out_dir: Path, metadata: dict[str, str], shard_bytes: int, next_index: int,
                 layer_count: int, hidden_size: int, store_dtype: str, on_reject=None,
                 max_local_bytes: int | None = None, compress: str | None = None, guard=None):
        self.out_dir = Path(out_dir)
        self.guard = guard  # called before each commit; the vLLM worker's exits if its driver is gone
        self.metadata = metadata
        self.attempt = metadata.get("attempt")  # an S3 output's writer id: in its shards' names (vx/store/fence.py)
        self.shard_bytes = shard_bytes
        self.layer_count = layer_count
        self.hidden_size = hidden_size
        self.store_dtype = store_dtype
        self.on_reject = on_reject  # called (sample_id, reason, line) in the writer thread for a sample failing check_states
        self.rejected: list[tuple[str, str]] = []
        self.max_local_bytes = max_local_bytes  # wait for the uploader to free disk before a shard
        self.compress = compress
        self.peak_local_bytes = 0
        self._token_bytes = bytes_per_token(store_dtype, layer_count, hidden_size) + 5  # + int32 id, uint8 mask
        self.open = PendingShard(next_index)
        self.committed_bytes = 0
        self.added_bytes = 0  # hidden states + ids + masks handed to add(), committed or not
        self.committed_shards = 0
        self._lock_file, holder = try_lock(self.out_dir / WRITER_LOCK)  # released by close() or our death
        if holder:
            raise VxError(f"{self.out_dir} is being written by {holder}; stop it (or wait for it) and rerun")
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._closed = False
        self.thread_cpu_s = 0.0
        # the threads that code blocks (--compress blocks; the codec releases the GIL)
        self._pool = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="vx-codec") if compress == "blocks" else None
        self._thread = threading.Thread(target=self._run, name="vx-shard-writer", daemon=True)
        self._thread.start()

    def add(self, sample_id: str, input_ids: list[int], loss_mask: list[int], hidden: torch.Tensor,
            line: int | None = None) -> None:
        """Queue one sample: hidden [T, L, H] (any dtype, CPU or device), T = len(input_ids).

        Only cheap work happens here, on the caller's (the forward's) time: a device tensor is
        copied to the host (freeing device memory), everything else is appended. The checks and
        the store-dtype encoding run in the writer thread, overlapped with the next forwards."""
        if hidden.device.type != "cpu":
            hidden = hidden.to("cpu")
        self._append(sample_id, input_ids, loss_mask, hidden, None, False, line)

    def add_encoded(self, sample_id: str, input_ids: list[int], loss_mask: bytes | list[int],
                    stored, scales, line: int | None = None, holds=()) -> None:
        """Queue one sample already checked and encoded (vLLM capture: done on the device).
        stored [T, L, H] and scales [T, L] | None, each a tensor or its rows in pieces (views
        of the capture's pinned ring, written from where they are); holds: the references that
        keep those views valid, dropped once the shard is written or abandoned."""
        try:
            self._append(sample_id, input_ids, loss_mask, stored, scales, True, line, holds)
        except BaseException:
            for h in holds:
                h.drop()
            raise

    def reject(self, sample_id: str, reason: str, line: int | None = None) -> None:
        """Record a sample whose states failed a check made before add (never committed)."""
        self.rejected.append((sample_id, reason))
        if self.on_reject is not None:
            self.on_reject(sample_id, reason, line)

    def _append(self, sample_id, input_ids, loss_mask, hidden, scales, encoded, line, holds=()) -> None:
        self._raise_if_failed()
        t = len(input_ids)
        shape = _rows_shape(hidden)
        if shape != (t, self.layer_count, self.hidden_size):
            raise RuntimeError(f"sample {sample_id}: hidden states {shape} != "
                               f"({t}, {self.layer_count}, {self.hidden_size})")
        s = self.open
        s.holds.extend(holds)
        s.ids.append(sample_id)
        s.lines.append(line)
        s.hidden.append(hidden)
        s.scales.append(scales)
        s.encoded.append(encoded)
        s.input_ids.append(torch.tensor(input_ids, dtype=torch.int32))
        s.loss_mask.append(torch.frombuffer(bytearray(loss_mask), dtype=torch.uint8) if isinstance(loss_mask, bytes)
                           else torch.tensor(loss_mask, dtype=torch.uint8))
        s.tokens += t
        nbytes = t * self._token_bytes  # as stored
        s.nbytes += nbytes
        self.added_bytes += nbytes
        if s.nbytes >= self.shard_bytes:
            self._hand_off()

    def flush(self) -> None:
        """Hand the open shard to the writer thread now, however full (the capture's ring needs
        the slots it holds back). Called from the thread that adds."""
        if self.open.ids:
            self._hand_off()

    @property
    def thread_id(self) -> int:
        """The writer thread's native id (benches count its CPU time)."""
        return self._thread.native_id

    def close(self) -> None:
        """Commit the last partial shard and wait for every write to finish (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.open.ids:
            self._hand_off()
        self._queue.put(None)
        self._thread.join()
        self._lock_file.close()
        self._raise_if_failed()

    def _hand_off(self) -> None:
        shard, self.open = self.open, PendingShard(self.open.index + 1)
        while True:
            try:
                self._queue.put(shard, timeout=0.5)
                return
            except queue.Full:
                if self._error is not None:
                    shard.drop_holds()
                self._raise_if_failed()

    @property
    def error(self) -> BaseException | None:
        """What stopped the writer thread, if anything (raised on the next add/close)."""
        return self._error

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, VxError):
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"shard writer failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            shard = self._queue.get()
            if shard is None:
                self.thread_cpu_s = time.thread_time()  # this thread's CPU seconds (vx selftest shows them)
                if self._pool is not None:
                    self._pool.shutdown()
                return
            if self._error is not None:
                shard.drop_holds()
                continue
            try:
                self.commit(shard)
            except OSError as e:  # ENOSPC and friends: stop cleanly; the temp file is removed on rerun
                self._error = VxError(f"writing shard {shard_name(shard.index, self.compress, self.attempt)} in {self.out_dir} failed: "
                                      f"{e.strerror or e}. Free space (or fix the disk) and rerun the same "
                                      "command to continue")
            except BaseException as e:  # surfaced to the caller on its next add()/close()
                self._error = e
            finally:
                shard.drop_holds()

    def check_and_encode(self, s: PendingShard) -> None:
        """Drop samples whose states fail check_states (reported, never written); encode the rest.
        Samples added already encoded were checked where they were computed."""
        keep = []
        for i, (sid, h) in enumerate(zip(s.ids, s.hidden)):
            if not s.encoded[i]:
                try:
                    check_states(h, len(s.input_ids[i]))
                except SampleRejected as e:
                    self.reject(sid, str(e), s.lines[i])
                    continue
                s.hidden[i], s.scales[i] = encode(h, self.store_dtype)
            keep.append(i)
        s.ids, s.lines = [s.ids[i] for i in keep], [s.lines[i] for i in keep]
        s.input_ids, s.loss_mask = [s.input_ids[i] for i in keep], [s.loss_mask[i] for i in keep]
        s.hidden = [p for i in keep for p in _pieces(s.hidden[i])]
        s.scales = [p for i in keep if s.scales[i] is not None for p in _pieces(s.scales[i])]
        s.tokens = sum(len(x) for x in s.input_ids)
        s.nbytes = s.tokens * self._token_bytes

    def commit(self, s: PendingShard) -> None:
        self.check_and_encode(s)
        if not s.ids:  # every sample rejected: nothing to write (the shard number stays unused)
            return
        name = shard_name(s.index, self.compress, self.attempt)
        tmp = self.out_dir / f".{name}.tmp"
        from vx.store.uploader import local_shard_bytes, wait_for_room

        used = (wait_for_room(self.out_dir, self.max_local_bytes, s.nbytes) if self.max_local_bytes is not None
                else local_shard_bytes(self.out_dir))
        self.peak_local_bytes = max(self.peak_local_bytes, used + s.nbytes)
        lengths = [len(x) for x in s.input_ids]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        meta = dict(self.metadata, format=SHARD_FORMAT, sample_ids=json.dumps(s.ids))
        tensors = {"hidden_states": s.hidden, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "offsets": [offsets]}
        shapes = {"hidden_states": [s.tokens, self.layer_count, self.hidden_size], "input_ids": [s.tokens],
                  "loss_mask": [s.tokens], "offsets": [len(lengths) + 1]}
        if s.scales:
            tensors["hidden_scales"], shapes["hidden_scales"] = s.scales, [s.tokens, self.layer_count]
        if self.compress == "blocks":  # lossless per ~1 MiB of rows, rows still a byte range (vx/store/blocks.py)
            from vx.store.blocks import code_rows

            coded, info = code_rows(tensors.pop("hidden_states"), shapes.pop("hidden_states"), self._pool)
            tensors = {info["tensor"]: coded, **tensors}
            shapes[info["tensor"]] = [info["index"][-1]]
            meta["coded"] = json.dumps({"hidden_states": info}, separators=(",", ":"))
        nbytes, crc = write_safetensors(tmp, tensors, shapes, meta, self.compress)
        faults.point("before-rename")
        os.rename(tmp, self.out_dir / name)
        fsync_dir(self.out_dir)
        faults.point("before-manifest")
        if self.guard is not None:
            self.guard()
        record = {"shard": name, "sample_ids": s.ids, "num_samples": len(s.ids), "num_tokens": s.tokens,
                  "sample_tokens": lengths, "bytes": nbytes, ALGO: crc}
        line = json.dumps(record) + "\n"
        with open(self.out_dir / MANIFEST, "a") as f:
            if faults.armed("mid-manifest"):  # tests: a crash that leaves half the line (a torn append)
                f.write(line[: len(line) // 2])
                f.flush()
                faults.point("mid-manifest")
                line = line[len(line) // 2:]
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        faults.point("after-manifest")
        self.committed_bytes += nbytes
        self.committed_shards += 1
