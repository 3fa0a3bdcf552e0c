"""vLLM worker extension: opens and closes a capture run inside vLLM's worker process.

Passed to vLLM as `worker_extension_cls="vx.engine.worker.VxWorkerExtension"`; vLLM mixes it into
its Worker class (V1 runner and Model Runner V2 alike), and the driver calls the `vx_*` methods
through `collective_rpc`. The capture itself is vx's KV connector (vx/engine/connector.py) and the
CaptureSink (vx/engine/sink.py); this extension only attaches a sink with a ShardWriter to the
connector for one run, reports progress, and closes it. Only tensor-parallel rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

WARMUP_PREFIX = "vxwarm-"


class VxWorkerExtension:
    """Methods run inside vLLM's worker process (prefix vx_ avoids clashes with Worker)."""

    def vx_begin(self, out_dir: str, shard_meta: dict, shard_bytes: int, next_shard: int, layer_count: int,
                 hidden_size: int, store_dtype: str, max_local_bytes: int | None = None,
                 compress: str | None = None, ring_bytes: int = 1 << 28, chunk_rows: int = 8192,
                 hold_bytes: int | None = None, staging: str = "auto", writer_hold_s: float = 0.0,
                 copy_bytes: int | None = None) -> None:
        """Open a ShardWriter and attach it to the capture connector (rank 0 only). ring_bytes,
        chunk_rows and hold_bytes: the driver's capture_budget for this engine's step and shard
        size (vx/engine/capture.py); staging, writer_hold_s and copy_bytes: vx selftest's
        backpressure stage."""
        from vx.engine.sink import CaptureSink
        from vx.engine.connector import worker_connector
        from vx.engine.lifetime.reaper import commit_guard
        from vx.store.writer import ShardWriter

        conn = worker_connector()
        if not conn.rank0:
            return
        if conn.sink is not None:
            raise RuntimeError("vx: a capture run is already open in this worker")
        writer = ShardWriter(Path(out_dir), shard_meta, shard_bytes, next_shard, layer_count, hidden_size,
                             store_dtype, max_local_bytes=max_local_bytes, compress=compress, guard=commit_guard())
        conn.sink = CaptureSink(writer, store_dtype, conn.kv_cache.device, ring_bytes=ring_bytes,
                                chunk_rows=chunk_rows, hold_bytes=hold_bytes, staging=staging,
                                writer_hold_s=writer_hold_s, copy_bytes=copy_bytes)

    def vx_watch_driver(self) -> bool:
        """Once the engine has started: this process ends if the driver dies (vx/engine/lifetime/reaper.py),
        and quickly when it is stopped (vx/engine/lifetime/fast_exit.py: a capture engine's connector
        installs that too; a regeneration engine's worker has only this extension, and its final
        garbage collection outlasted vLLM's 5 s shutdown grace beside a running capture)."""
        from vx.engine.lifetime import fast_exit
        from vx.engine.lifetime.reaper import watch_driver

        fast_exit.install()
        return watch_driver()

    def vx_status(self) -> dict:
        """Samples the worker has taken from finished requests so far, and any writer failure."""
        from vx.engine.connector import worker_connector

        sink = worker_connector().sink
        if sink is None:
            return {}
        return {"received": sink.received, "tokens": sink.tokens, "error": sink.error()}

    def vx_finish(self) -> dict:
        """Commit the last shard, detach the sink, return its stats."""
        from vx.engine.connector import worker_connector

        conn = worker_connector()
        sink, conn.sink = conn.sink, None
        if sink is None:
            return {}
        try:
            sink.close()
        except Exception as e:  # the writer failed (a full disk): the driver says it in one line; raised
            # here, vLLM would hand the driver a generic Exception wrapping it (a traceback)
            return {"error": str(e)}
        w = sink.writer
        return {"samples": sink.received, "tokens": sink.tokens, "shards": w.committed_shards,
                "bytes": w.committed_bytes, "rejected": w.rejected, "peak_local_bytes": w.peak_local_bytes,
                "ring_waits": sink.ring_waits, "ring_spills": sink.ring_spills, "ring_bytes": sink.ring_bytes, "chunk_rows": sink.chunk_rows,
                "zero_copy_rows": sink.zero_copy_rows, "copied_rows": sink.copied_rows,
                "hidden_block": conn.block_size, "intake_cpu_s": sink.intake_cpu_s, "writer_cpu_s": w.thread_cpu_s}

    def vx_changes(self) -> dict[str, str]:
        """vx's changes to vLLM active in this worker's process (vx/engine/patches/): change -> module."""
        from vx.engine.patches import ACTIVE

        return dict(ACTIVE)

    def vx_kv_groups(self) -> int:
        """KV cache groups the engine planned (vx's change hidden_state_billing: one per layer, + vx's)."""
        return len(self.model_runner.kv_cache_config.kv_cache_groups)

    def vx_param_count(self, substring: str) -> int:
        """Parameters of the loaded model whose name contains `substring` (tests: no vision tower)."""
        return sum(p.numel() for n, p in self.model_runner.get_model().named_parameters() if substring in n)
