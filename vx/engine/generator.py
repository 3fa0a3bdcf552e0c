"""The engine side of `vx regenerate`: one vLLM engine, every conversation in flight.

Conversations are read ahead up to 4x the engine's max_num_seqs; each turn goes in as token ids
rendered by vx's chat template; when turn k of a conversation finishes, turn k+1 is submitted
on the regenerated history (prefix caching on, so it shares the KV of everything before it);
a finished conversation is handed to the output. The engine dies with the driver (vx/engine/lifetime/reaper.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from pathlib import Path

from vx import faults
from vx.data.chat import tools_of
from vx.engine import patches
from vx.errors import raise_if_stopped
from vx.data.generation import Conversation
from vx.store.text_output import sidecar


def split_reasoning(text: str, separate: bool) -> dict:
    """The generated text as message fields: thinking in reasoning_content when the template
    renders that field, else kept inline as the model wrote it."""
    if separate and "</think>" in text:
        thinking, _, answer = text.partition("</think>")
        return {"reasoning_content": thinking.replace("<think>", "", 1).strip("\n"), "content": answer.lstrip("\n")}
    return {"content": text}


ENGINE_GOMP = "VX_ENGINE_GOMP_CPU_AFFINITY"  # GOMP_CPU_AFFINITY for the engine's start only (vx/jobs/one_pass.py)


def unpin(pid: int) -> None:
    """Every thread of process pid back on every core this process may use (libgomp pinned its
    main thread, and the threads it started since, to the first core of GOMP_CPU_AFFINITY)."""
    cores = os.sched_getaffinity(0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)


def generated_text(tokenizer, prompt_ids: list[int], gen) -> str:
    """A turn's text from its ids, as vLLM's detokenizer writes it (its FastIncrementalDetokenizer,
    0.32 and 0.33): a tokenizers DecodeStream primed with the prompt, special tokens skipped, the
    token that stopped the turn (an EOS or a stop token id) left out, and a last character the
    turn's end cut in half left out too (the stream never completes it)."""
    ids = list(gen.token_ids)
    if ids and gen.finish_reason == "stop" and not isinstance(gen.stop_reason, str):
        ids = ids[:-1]
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:  # a slow tokenizer: no stream to follow
        return tokenizer.decode(ids, skip_special_tokens=True)
    from tokenizers.decoders import DecodeStream

    stream, parts = DecodeStream(ids=prompt_ids, skip_special_tokens=True), []
    for t in ids:
        try:
            parts.append(stream.step(backend, t) or "")
        except Exception as e:  # vLLM's recovery from a non-monotonic prefix: a fresh stream
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            parts.append(stream.step(backend, t) or "")
    return "".join(parts)


def preload(tensor_parallel_size: int, output: Path) -> None:
    """vLLM's modules imported ahead of start_engine (their notices to its log), for a process
    that has time to spare before it knows the engine's settings."""
    from vx.device import engine_env
    from vx.engine.lifetime.logs import engine_output

    with engine_output(sidecar(output, ".vllm.log")):
        engine_env(tensor_parallel_size)
        patches.enable()
        from vllm import LLM  # noqa: F401


def start_engine(cfg, model_dir: Path, log: Path):
    """A vLLM engine without capture (vx's worker extension only to watch the driver), prefix
    caching on, and no tokenizer: vx renders and tokenizes each turn and decodes what the engine
    generated (vLLM would load the tokenizer twice and copy it twice, ~7 s of a core on a start's
    critical path for the 248k-entry Qwen3.6 one); its log in `log`."""
    from vx.device import engine_env
    from vx.data.model import model_info
    from vx.engine.defaults import memory_kwargs
    from vx.engine.lifetime.logs import engine_output, without_tokenizer
    from vx.engine.vllm_engine import EXTENSION

    without_tokenizer()
    with engine_output(log, cfg.verbose):
        on_cpu = engine_env(cfg.tensor_parallel_size)
        patches.enable()  # vx's changes to vLLM (its CPU ones: a seeded request's chunked prefill)
        from vllm import LLM

        kw = dict(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                  enable_prefix_caching=True, seed=cfg.seed or 0,
                  tensor_parallel_size=cfg.tensor_parallel_size, worker_extension_cls=EXTENSION)
        if on_cpu:
            kw.update(dtype="bfloat16", enforce_eager=True)
        longest = cfg.max_model_len or (model_info(model_dir).max_position_embeddings if on_cpu else None)
        kw.update(memory_kwargs(on_cpu, cfg.gpu_memory_utilization, longest))  # on CPU, sized to the job
        for k in ("max_num_seqs", "max_model_len"):
            if getattr(cfg, k):
                kw[k] = getattr(cfg, k)
        gomp = os.environ.pop(ENGINE_GOMP, None)  # in the engine's processes only, and only their start:
        if gomp:  # this process's libgomp read its own binding at torch's import, without it
            os.environ["GOMP_CPU_AFFINITY"] = gomp
        llm = LLM(**kw)
        if gomp:  # the worker keeps its OpenMP threads' binding; its engine core runs anywhere again
            from vx.engine.vllm_engine import engine_processes

            for p in engine_processes(llm.llm_engine):
                unpin(p.pid)
        return llm


def generate(cfg, model_dir, tokenizer, chat, separate, first, convs, out, bar, stats, ready=None,
             before_stop=None) -> dict:
    """Every conversation in flight in one engine; returns generate_s (first request to last commit).
    ready(): called once the engine has started, before the first request; before_stop(): once
    every conversation is committed, before the engine stops (not after a failure)."""
    from vx.engine.lifetime.liveness import start_watched
    from vx.engine.lifetime.reaper import Reaper
    from vx.engine.vllm_engine import stop_engine, tokens_input

    reaper = Reaper.start()  # the engine dies with this process, SIGKILL included
    try:  # and this process with its engine: no call waits on a dead one (vx/engine/lifetime/liveness.py)
        llm, watch = start_watched(lambda: start_engine(cfg, model_dir, sidecar(out.path, ".vllm.log")),
                                   kept="committed conversations are kept, rerun the same command to continue")
    except BaseException:
        reaper.stop()
        raise
    from vllm import (
        SamplingParams,  # after the engine start: vLLM's import notices go to its log
    )

    watch.guard(llm).collective_rpc("vx_watch_driver")  # a second line, should the reaper die with this process
    raw_engine = llm.llm_engine
    engine = watch.guard(raw_engine)
    window = 4 * engine.vllm_config.scheduler_config.max_num_seqs  # conversations read ahead
    active: dict[str, Conversation] = {}

    # the tokenizer's EOS ends a turn as it would in vLLM's own (the generation config's are the
    # engine's); the ids come back undecoded
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts: dict[str, list[int]] = {}  # each conversation's turn in flight: its prompt's ids

    def params(conv: Conversation):
        seed = None if cfg.seed is None else (cfg.seed + zlib.crc32(f"{conv.id}/{conv.todo[0]}".encode())) % (1 << 31)
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_tokens=cfg.max_tokens, seed=seed, stop_token_ids=eos, detokenize=False)

    def submit(conv: Conversation) -> None:
        k = conv.todo[0]
        text = chat.render(conv.messages[:k], tools_of(conv.record), gen=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        conv.turns.append({"index": k, "prompt_tokens": len(ids)})
        prompts[conv.id] = ids
        engine.add_request(f"{conv.id}\x00{k}", tokens_input(ids), params(conv))

    def finish(conv: Conversation) -> None:
        watch.check()  # nothing is committed once the engine is dead
        stats["conversations"] += 1
        if conv.truncated:
            stats["truncated"] += 1
        if conv.truncated and cfg.drop_truncated:
            stats["dropped"] += 1
            bar.skip(1)
            return
        rec = {k: v for k, v in conv.record.items() if k not in ("conversations", cfg.messages_field)}
        rec.update(id=conv.id, messages=conv.messages, vx_turns=conv.turns)
        out.add(rec, cfg.commit_every)
        bar.advance(1, 0, 0)

    def refill(conv) -> bool:
        """Read conversations until `window` are in flight; False when the input is done."""
        while len(active) < window:
            conv = conv or next(convs, None)
            if conv is None:
                return False
            active[conv.id] = conv
            submit(conv)
            conv = None
        return True

    try:
        if ready is not None:
            ready()
        t_gen = time.perf_counter()
        out.commit()  # starts the chunk clock now, not before the engine's start
        more = refill(first)
        while active or more:
            raise_if_stopped()
            for o in engine.step():
                if not o.finished:
                    continue
                sid, _, k = o.request_id.partition("\x00")
                conv = active[sid]
                gen = o.outputs[0]
                text = generated_text(tokenizer, prompts.pop(sid), gen)
                conv.messages[int(k)] = {"role": "assistant", **split_reasoning(text, separate)}
                turn = conv.turns[-1]
                turn.update(finish_reason=gen.finish_reason, completion_tokens=len(gen.token_ids))
                if gen.finish_reason == "length":
                    turn["truncated"], conv.truncated = True, True
                stats["turns"] += 1
                stats["generated_tokens"] += len(gen.token_ids)
                bar.advance(0, len(gen.token_ids), 0)
                conv.todo.pop(0)
                if conv.todo:
                    submit(conv)  # the next turn, on the regenerated history
                else:
                    del active[sid]
                    finish(conv)
            faults.point("after-step")
            if more:
                more = refill(None)
        watch.check()
        out.commit()
        t_done = time.perf_counter()  # every conversation written and fsynced; the engine's stop is not generation
        bar.emit("committed")  # a follower (vx extract --regenerate) may finish while the engine stops
        if before_stop is not None:  # every conversation committed: the engine's death loses nothing from
            watch.close()  # now on (watched, it would end this process with an error after GRACE_S)
            before_stop()
    finally:
        with contextlib.suppress(Exception):
            stop_engine(raw_engine, watch)
        reaper.stop()
    return {"generate_s": round(t_done - t_gen, 3)}
