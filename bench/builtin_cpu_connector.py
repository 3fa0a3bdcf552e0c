"""vLLM's own ExampleHiddenStatesConnector, as a user gets it, adapted to CPU only where it calls CUDA.

The stock connector gathers a finished request's rows on a CUDA side stream into pinned memory
and writes one safetensors file per request from a thread pool. On a CPU build `torch.cuda`
streams, events and `pin_memory=True` are unavailable; this subclass replaces exactly that part
(the gather is then a plain copy, done at once) and keeps everything else: per-request files,
the thread pool, the lock files clients wait on. On a GPU the bench uses the stock class.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _DoneEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuExampleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # a copy
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _DoneEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
