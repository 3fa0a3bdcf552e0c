"""The vLLM engine vx starts: its arguments (vx's worker extension and KV connector, prefill-only
requests of the tokenizer's own ids), kernel warm-up before the timed loop, and a shutdown that
does not wait on a busy engine core. Used by extraction, `vx regenerate` and `vx selftest`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from vx.data.samples import Sample
from vx.engine.worker import WARMUP_PREFIX

EXTENSION = "vx.engine.worker.VxWorkerExtension"
# CPU default: eager. Compiled measured slower on CPU (bench/throughput.py, docs/performance.md) and
# starts ~60 s slower cold; on a GPU vLLM's default (compiled, CUDA graphs) is used.
EAGER_ON_CPU = True


def request_params(s: Sample):
    """Prefill only; the sample's id, line, loss mask and real length ride along for the worker."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          extra_args={"vx_id": s.id, "vx_line": s.line, "vx_mask": bytes(s.loss_mask),
                                      "vx_keep": len(s)})


def tokens_input(ids: list[int]) -> dict:
    """A prompt already in token ids, in the engine's own input form (vllm.inputs.engine
    TokensInput, the same in 0.32 and 0.33): no renderer pass, vLLM's input checks still run."""
    return {"type": "token", "prompt_token_ids": ids}


def prompt_ids(s: Sample) -> list[int]:
    """The token ids submitted for a sample. A 1-token prompt crashes vLLM 0.32's CPU GDN conv
    kernel ('causal_conv1d_fwd_cpu: expect x to be transposed'), so it is sent as 2 tokens and only
    row 0 is kept: by causality row 0 depends on token 0 alone, so its states are exact."""
    return s.input_ids * 2 if len(s) == 1 else s.input_ids


def engine_kwargs(model_dir: Path, layer_ids: list[int], *, on_cpu: bool, vision_language: bool = False,
                  dtype: str = "auto", max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                  max_num_seqs: int | None = None, gpu_memory_utilization: float | None = None,
                  tensor_parallel_size: int = 1, enforce_eager: bool | None = None, seed: int = 0,
                  overrides: dict | None = None) -> dict:
    """The engine vx builds: vLLM's extract_hidden_states method + vx's connector + extension.
    `overrides` are further engine arguments (bench: load_format="dummy" for random weights)."""
    from vx.engine.connector import CONNECTOR, MODULE
    from vx.engine.defaults import CPU_MAX_NUM_BATCHED_TOKENS, default_budget, memory_kwargs

    if enforce_eager is None:
        enforce_eager = EAGER_ON_CPU if on_cpu else False
    kwargs = dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16" if on_cpu and dtype == "auto" else dtype,
        enable_prefix_caching=False, **memory_kwargs(on_cpu, gpu_memory_utilization, max_model_len),
        tensor_parallel_size=tensor_parallel_size, worker_extension_cls=EXTENSION, seed=seed,
        enforce_eager=enforce_eager, enable_chunked_prefill=True,
        # vx sends token ids and reads no text: no tokenizer in the engine (~1.5 s of a core to
        # load it, twice: the front end, which also copies it for a thread pool, and the engine core)
        skip_tokenizer_init=True,
        # vLLM's index j is the stream entering layer j (0 = embeddings): our id k is index k + 1;
        # states come back in ascending order, so the ids must be sorted
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {
                                "eagle_aux_hidden_state_layer_ids": [k + 1 for k in sorted(layer_ids)]}}},
        kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
                            "kv_role": "kv_producer"},
    )
    if not on_cpu:
        max_num_batched_tokens, max_num_seqs = default_budget(max_num_batched_tokens, max_num_seqs)
    elif not max_num_batched_tokens:
        max_num_batched_tokens = CPU_MAX_NUM_BATCHED_TOKENS
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    if vision_language:
        kwargs["language_model_only"] = True  # no vision encoder weights, memory or compute
    return dict(kwargs, **(overrides or {}))


def warm_up(engine, step_tokens: int, max_model_len: int, params, buckets: bool = True) -> float:
    """Dummy prefills covering the token-count buckets a run will see, up to a full step
    (kernels compile and autotune here, not in the timed loop); a bucket larger than the longest
    request the engine takes is filled by several. vx's engine does not capture them (params
    carry vx_warmup). buckets=False (an eager engine on CPU, see warms_buckets): one short
    prefill, for the first-call setup only."""
    t0 = time.perf_counter()
    longest = max_model_len - 1
    sizes, n = [], 16
    while n < step_tokens and buckets:
        sizes.append(n)
        n *= 4
    sizes.append(step_tokens if buckets else min(16, step_tokens))
    i = 0
    for size in sizes:
        while size > 0:
            engine.add_request(f"{WARMUP_PREFIX}{i}", tokens_input([1] * max(2, min(size, longest))), params)
            size -= longest
            i += 1
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - t0


def warms_buckets(device_type: str, enforce_eager: bool) -> bool:
    """Whether a warm-up must sweep the step's token-count buckets. A compiled engine builds a
    graph per bucket, and a GPU's Triton kernels (the GDN layers', eager or not) compile and
    autotune on first use, specialised on their size arguments. An eager engine on CPU runs
    vLLM's C++ kernels and oneDNN, which build nothing per bucket, so its sweep only costs time
    (the README's first job on 2 cores: 24 s of warm-up before a 26 s extraction, measured)."""
    return not (device_type == "cpu" and enforce_eager)


def stop_engine_core(engine, pokes: int = 5, wait_s: float = 8.0) -> None:
    """vLLM stops its EngineCore with SIGTERM, handled by a Python handler, and Python runs a
    handler only in the main thread: an idle core's main thread sleeps in its input queue, and
    when the kernel hands the signal to another of its threads it sleeps through it until vLLM
    force-kills it 5 s later, leaving its shared memory to the resource tracker (2 of 3 runs here).
    So vx stops the core itself: SIGTERM, then a few no-op requests (aborts of an unknown id) that
    wake the main thread so the handler runs, then it waits for the core to tear down on its own
    (SIGKILL only after wait_s). vLLM's process manager is told first that its processes are taken
    care of (its one-shot finalizer detached, the same in 0.32 and 0.33), so neither its liveness
    monitor nor its shutdown sends a second SIGTERM into a core whose handler is already reset;
    vLLM's client shutdown then only cleans up."""
    client, resources, finalizer, procs = _engine_processes(engine)
    if procs and finalizer is not None and finalizer.detach() is not None:
        for p in procs:
            p.terminate()
        for _ in range(pokes):
            time.sleep(0.02)
            try:
                client.abort_requests(["vx-wake"])
            except Exception:
                break
        resources.engine_dead = True  # the client's liveness monitor now stays quiet
        _join_or_kill(procs, time.monotonic() + wait_s)
    client.shutdown()


def engine_processes(engine) -> list:
    """The engine's processes vLLM started and that are still alive (its core; on CPU its worker is the core's child)."""
    return _engine_processes(engine)[3]


def _engine_processes(engine):
    """(vLLM's client, its background resources, its process manager's one-shot finalizer, the
    manager's processes still alive): the same in 0.32 and 0.33."""
    client = engine.engine_core
    resources = getattr(client, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    procs = [p for p in getattr(manager, "processes", []) if p.is_alive()]
    return client, resources, getattr(manager, "_finalizer", None), procs


def _join_or_kill(procs, deadline: float) -> None:
    """Each process's exit by the deadline, else SIGKILL."""
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def stop_engine(engine, watch) -> None:
    """The end of an engine vx started, alive or dead: its watch first (stopping it is not a
    death), then stop_engine_core, or for a dead one only what vLLM's client still holds."""
    watch.close()
    if watch.dead:
        end_dead_engine(engine)
    else:
        stop_engine_core(engine)


def end_dead_engine(engine, wait_s: float = 2.0) -> None:
    """An engine one of whose processes died: what still runs of it (its core, often) gets SIGTERM,
    and SIGKILL after wait_s, before vLLM's client cleans up. No RPC: nothing of it is asked
    anything. Left to vLLM, its process manager waited 5 s for a core whose SIGTERM handler may
    never run (see stop_engine_core), then logged its force kill after vx's one-line error
    (campaign seed 61, trial 35; a race: the same trial passed twice since, before this and after).
    The processes are ended here whether or not vLLM's own monitor thread began its shutdown."""
    client, resources, finalizer, procs = _engine_processes(engine)
    if finalizer is not None:
        finalizer.detach()  # vLLM's shutdown of them (or the one its monitor thread began) finds them gone
    if resources is not None:
        resources.engine_dead = True
    for p in procs:
        with contextlib.suppress(OSError):
            p.terminate()
    with contextlib.suppress(OSError):
        _join_or_kill(procs, time.monotonic() + wait_s)
    client.shutdown()
