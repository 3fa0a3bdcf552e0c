"""vLLM backend driver: stream samples into vLLM's continuous-batching engine, prefill only.

The engine runs vLLM's `extract_hidden_states` speculative method with vx's KV connector
(vx/engine/connector.py): the target layers' residual streams are set as aux outputs at load time
(so torch.compile and CUDA graphs include them), cached per token as chunks are computed, and
read once per finished request in the worker process, which writes the shards. The driver only
submits requests and follows progress; hidden states never travel through vLLM's RPC. Requests
are the model tokenizer's own token ids (no re-tokenization), `max_tokens=1` (the sampled token
is discarded), prefix caching off (a cached prefix would never be recomputed, so its states would
be missing). A bounded number of requests is in flight; new ones join as others finish.
The engine's arguments, warm-up and shutdown are vx/engine/vllm_engine.py.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterable, Iterator

from vx import faults
from vx.data.samples import PENDING, Sample
from vx.engine.capture import capture_budget
from vx.engine.contract import check_vllm_contract
from vx.engine.defaults import check_tensor_parallel_pages
from vx.engine.lifetime.liveness import start_watched
from vx.engine import patches
from vx.engine.lifetime.logs import engine_output, vllm_log_path, without_tokenizer
from vx.engine.plan_start import plan_capture_engine
from vx.engine.vllm_engine import (
    engine_kwargs,
    prompt_ids,
    request_params,
    stop_engine,
    tokens_input,
    warm_up,
    warms_buckets,
)
from vx.errors import EngineDied, UsageError, VxError, raise_if_stopped

DRAIN_TIMEOUT_S = 600.0  # after the last request finished, the worker must have taken every sample
FINISH_WHEN_STOPPED_S = 5.0  # Ctrl-C / SIGTERM: the worker may commit its last shard this long
STATUS_EVERY_S = 2.0     # how often the driver asks the worker whether its writer failed
PENDING_POLL_S = 0.05    # a following input with nothing committed and nothing in flight: wait this long


class VllmExtractor:
    """One vLLM engine with vx's capture connector; `run()` can be called repeatedly."""

    def __init__(self, model_dir: Path, layer_ids: list[int], log_file: Path | None = None, verbose: bool = False,
                 warm: bool = True, sample_lengths=None, **options):
        """log_file: where vLLM's log and its processes' output go (vx/engine/lifetime/logs.py); None = stderr.
        sample_lengths: the token counts of the samples the run will submit, in order (the step
        budget is chosen from them; None: unknown)."""
        if list(layer_ids) != sorted(set(layer_ids)):
            raise UsageError(f"layer ids must be sorted and distinct, got {layer_ids}")
        try:
            with engine_output(log_file, verbose):
                self._start(model_dir, layer_ids, sample_lengths, options)
        except VxError:
            raise
        except Exception as e:  # the details went to the log file
            if log_file is None or verbose:
                raise
            raise VxError(f"the vLLM engine failed to start ({type(e).__name__}: {str(e)[:300]}); "
                          f"its log: {log_file}") from e
        self.warmup_s = self.warm_up() if warm else 0.0

    def _start(self, model_dir: Path, layer_ids: list[int], lengths, options: dict) -> None:
        from vx.device import engine_env
        from vx.engine.lifetime.reaper import Reaper

        on_cpu = engine_env(options.get("tensor_parallel_size", 1))
        self.changes = patches.enable()  # vx's changes to vLLM, in this engine's processes only
        kwargs = engine_kwargs(model_dir, layer_ids, on_cpu=on_cpu, **options)
        check_vllm_contract(kwargs)  # before any weight loads: one line naming what is missing
        # max_model_len rounded so the hidden-state block is the largest vLLM allows (vx/engine/plan.py)
        # and the step and max_num_seqs chosen from the plan and the run's lengths (vx/engine/budget.py)
        given = dict(options, **(options.get("overrides") or {}))  # the caller's step and count are kept
        kwargs, self.plan, self.budget = plan_capture_engine(
            kwargs, len(layer_ids), lengths, given.get("max_num_batched_tokens"), given.get("max_num_seqs"))
        dtype_bytes = 4 if kwargs["dtype"] == "float32" else 2
        check_tensor_parallel_pages(model_dir, kwargs["tensor_parallel_size"], len(layer_ids), dtype_bytes)
        without_tokenizer()
        from vllm import LLM

        self.layer_ids = list(layer_ids)
        self.reaper = Reaper.start()  # the engine's processes die with this one, even by SIGKILL
        llm, self.watch = start_watched(lambda: LLM(**kwargs))  # and this one with its engine (liveness.py)
        self._engine = llm.llm_engine  # unwatched: for the shutdown
        self.llm, self.engine = self.watch.guard(llm), self.watch.guard(llm.llm_engine)
        self.llm.collective_rpc("vx_watch_driver")  # a second line, should the reaper die with this process
        self.active_changes = sorted(self.llm.collective_rpc("vx_changes")[0])  # read back from rank 0
        config = self.engine.vllm_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        self.enforce_eager = config.model_config.enforce_eager
        self.device_type = config.device_config.device_type
        self.cache_dtype = config.model_config.dtype  # the hidden-state cache holds the model's dtype
        if self.plan is not None:  # the blocks vLLM found room for, as its client was told
            self.plan.num_blocks = getattr(config.cache_config, "num_gpu_blocks", None)

    @staticmethod
    def _warmup_params():
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={"vx_warmup": 1})

    def warm_up(self) -> float:
        return warm_up(self.engine, self.max_num_batched_tokens, self.max_model_len, self._warmup_params(),
                       buckets=warms_buckets(self.device_type, self.enforce_eager))

    def run(self, samples: Iterable[Sample], out_dir: Path, shard_meta: dict, shard_bytes: int, next_shard: int,
            hidden_size: int, store_dtype: str, max_local_bytes: int | None = None, compress: str | None = None,
            on_done=None, on_reject=None,
            max_in_flight: int | None = None, backpressure_s: float = 0.0, staging: str = "auto") -> dict:
        """Extract every sample into shards under out_dir. Returns the worker's stats.
        backpressure_s > 0 (vx selftest): the ring path on any device, the ring cut to the copies in
        flight (no writer share) and the writer started that late, so the forward waits for space;
        on a GPU the forward also waits for each chunk's copy (the bound on copies in flight).
        staging="ring": the GPU's staging through the pinned ring on any device (tests on CPU)."""
        budget = capture_budget(self.max_num_batched_tokens, len(self.layer_ids), hidden_size, store_dtype,
                                self.cache_dtype, shard_bytes=shard_bytes)
        stress = {} if staging == "auto" else {"staging": staging}
        if backpressure_s:  # ring_bytes - hold_bytes: the copies in flight, whatever the shard size
            budget.update(ring_bytes=budget["ring_bytes"] - budget["hold_bytes"], hold_bytes=0)
            stress = {"staging": "ring", "writer_hold_s": float(backpressure_s), "copy_bytes": 0}
        self.llm.collective_rpc("vx_begin", args=(str(out_dir), shard_meta, shard_bytes, next_shard,
                                                  len(self.layer_ids), hidden_size, store_dtype, max_local_bytes,
                                                  compress, budget["ring_bytes"], budget["chunk_rows"],
                                                  budget["hold_bytes"]), kwargs=stress)
        cap = max_in_flight or 2 * self.max_num_seqs
        in_flight: dict[str, Sample] = {}
        self.in_flight = in_flight  # read by the run's meter (requests in the engine now)
        lines: dict[str, int] = {}  # sample id -> dataset line, for rejections reported at the end
        it: Iterator[Sample] = iter(samples)
        exhausted = False
        seq = submitted = 0
        next_status = time.monotonic() + STATUS_EVERY_S
        stopped = False
        try:
            while True:
                raise_if_stopped()
                if not exhausted and len(in_flight) < cap:
                    new = []
                    while len(in_flight) + len(new) < cap:
                        s = next(it, None)
                        if s is None:
                            exhausted = True
                            break
                        if s is PENDING:  # a following input (vx/data/follow.py): nothing committed yet
                            break
                        if len(s) >= self.max_model_len:
                            if on_reject:
                                on_reject(s, f"{len(s)} tokens >= the engine's max_model_len {self.max_model_len}")
                            continue
                        new.append((f"vx-{seq}", s))
                        lines[s.id] = s.line
                        seq += 1
                    for key, s in new:
                        self.engine.add_request(key, tokens_input(prompt_ids(s)), request_params(s))
                        in_flight[key] = s
                        submitted += 1
                if not in_flight:
                    if exhausted:
                        break
                    time.sleep(PENDING_POLL_S)  # waiting on a following input, nothing to step
                    continue
                faults.point("after-step")
                for out in self.engine.step():
                    if out.finished:
                        s = in_flight.pop(out.request_id, None)
                        if s is not None and on_done:
                            on_done(s)
                if time.monotonic() >= next_status:  # a failed writer (disk full) stops the run early
                    self._raise_if_worker_failed()
                    next_status = time.monotonic() + STATUS_EVERY_S
            self._drain(submitted)
        except BaseException as e:  # interrupted or failed: stop computing what nobody will take
            stopped = isinstance(e, KeyboardInterrupt)
            if in_flight and not self.watch.dead:
                with contextlib.suppress(Exception):
                    self.engine.abort_request(list(in_flight))
            raise
        finally:
            if not self.watch.dead:
                try:  # commits the last shard; bounded when the run was stopped, and by the engine's life
                    with self.watch.call("vx_finish", FINISH_WHEN_STOPPED_S if stopped else None):
                        stats = self.llm.collective_rpc("vx_finish")[0]
                except EngineDied:
                    if not stopped:
                        raise  # else the interruption goes on up
        if stats.get("error"):  # found by the fault campaign: an I/O error at the last commit
            raise VxError(stats["error"])
        for sample_id, reason in stats.get("rejected", []):
            if on_reject:
                on_reject(Sample(sample_id, lines.get(sample_id, 0), [], []), reason)
        return stats

    def _raise_if_worker_failed(self) -> dict:
        status = self.llm.collective_rpc("vx_status")[0]
        if status.get("error"):
            raise VxError(status["error"])
        return status

    def _drain(self, submitted: int) -> None:
        """Every request has finished; the engine core keeps stepping (in its own process) until
        the connector has read the last ones. Wait until the worker has taken every sample."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (status := self._raise_if_worker_failed()).get("received", 0) < submitted:
            if time.monotonic() > deadline:
                raise VxError(f"the vLLM worker took {status.get('received')} of {submitted} finished samples "
                              f"in {DRAIN_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the engine (a dead one: only what vLLM's client holds, and any worker left)."""
        with contextlib.suppress(Exception):
            stop_engine(self._engine, self.watch)
        self.reaper.stop()


def run_vllm(cfg, model_dir, info, layer_ids, samples, shard_args, bar, t0, errors, started=None, captured=None,
             lengths=None):
    """The `vx extract --backend vllm` job; returns (load_s, warmup_s, extract_s, samples, tokens, stats).
    lengths: the token counts of the samples, in order, where the plan knows them (the step budget).
    started(): called once the engine has started (and warmed up), before the first sample;
    captured(): once every sample is committed, before the engine stops."""
    if cfg.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {cfg.dtype} is not supported by the vllm backend")
    t_load = time.perf_counter()
    ex = VllmExtractor(model_dir, layer_ids, log_file=vllm_log_path(cfg.output), verbose=cfg.verbose,
                       vision_language=info.vision_language, dtype=cfg.dtype,
                       max_model_len=cfg.max_model_len,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                       gpu_memory_utilization=cfg.gpu_memory_utilization,
                       tensor_parallel_size=cfg.tensor_parallel_size, enforce_eager=cfg.enforce_eager,
                       warm=cfg.warm_up, sample_lengths=lengths)
    load_s = time.perf_counter() - t_load - ex.warmup_s + (t_load - t0)
    counts = {"n": 0, "tokens": 0}
    bar.meter.sources.append(lambda: {"in_flight": len(getattr(ex, "in_flight", ()))})

    def done(s: Sample):
        counts["n"] += 1
        counts["tokens"] += len(s)
        bar.advance(1, len(s), counts["tokens"] * len(layer_ids) * info.hidden_size * 2)

    def reject(s: Sample, reason: str):
        errors.write({"line": s.line, "id": s.id, "reason": reason})
        bar.skip(1)

    t1 = time.perf_counter()
    try:
        if started is not None:
            started()
        stats = ex.run(samples, cfg.output, *shard_args, on_done=done, on_reject=reject)
        extract_s = time.perf_counter() - t1  # the engine's shutdown is not extraction time
        if captured is not None:
            captured()
    finally:
        ex.close()
    stats["max_model_len"] = ex.max_model_len
    stats["vllm_changes"] = ex.active_changes
    if ex.plan is not None:
        stats["plan"] = ex.plan.line() + (f"; {ex.budget.line}" if ex.budget is not None else "") + \
            f"; vx's changes to vLLM active in the engine: {', '.join(ex.active_changes) or 'none'}"
    return load_s, ex.warmup_s, extract_s, counts["n"] - len(stats.get("rejected", [])), counts["tokens"], stats
