"""`vx regenerate`: the target writes the assistant turns, before extraction.

Every conversation keeps its system, user and tool turns; its assistant turns are regenerated in
order, each conditioned on the regenerated history (`turns="last"`: only the final one; a
conversation ending in a user turn gets a reply). All conversations are in flight together in
one vLLM engine (continuous batching, prefix caching on: a conversation's next turn shares its
history with the request before it): turn k+1 of a conversation is submitted the moment its
turn k finishes.

The output is the `messages` JSONL that `vx extract` reads, ids kept, plus per conversation
`vx_turns`: per regenerated turn its message index, finish_reason and token counts. It is
append-only and committed in fsynced chunks; a rerun drops a torn last line, skips the ids
already written and regenerates the rest. Bad records go to OUTPUT.errors.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from . import faults
from .chat import ChatTemplate, conversation, tools_of
from .errors import UsageError
from .shards import try_lock
from .sources import BadRecord, Input


@dataclass
class Conversation:
    id: str
    record: dict
    messages: list[dict]
    todo: list[int]                        # indexes of the assistant turns still to (re)generate
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False


@dataclass
class RegenConfig:
    data: str
    output: Path
    model: str | None = None
    turns: str = "all"                      # all | last
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    seed: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: str | None = None
    messages_field: str = "messages"
    id_field: str = "id"
    drop_truncated: bool = False
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    commit_every: int = 64                  # conversations per fsynced chunk (and at most 2 s apart)
    endpoint_url: str | None = None
    verbose: bool = False

    def __post_init__(self):
        self.output = Path(self.output)
        if self.turns not in ("all", "last"):
            raise UsageError(f"--turns must be all or last, got {self.turns!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1 or self.commit_every < 1:
            raise UsageError("--temperature >= 0, 0 < --top-p <= 1, --max-tokens >= 1 are required")
        from .config import check_template_options

        self.template_kwargs = check_template_options(self.chat_template, self.chat_template_kwargs)


def plan(rec: dict, row_index: int, cfg: RegenConfig) -> Conversation:
    """The conversation of one record and the assistant turns to generate."""
    field_name = cfg.messages_field if cfg.messages_field in rec else "conversations"
    if field_name not in rec:
        raise BadRecord(f"no {cfg.messages_field!r} (--messages-field) or 'conversations'")
    msgs = conversation(rec[field_name])
    sid = rec.get(cfg.id_field, row_index)
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise BadRecord(f"{cfg.id_field!r} must be a string or an integer")
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if msgs[-1]["role"] != "assistant":  # ends in a user (or tool) turn: it gets a reply
        msgs.append({"role": "assistant", "content": ""})
        assistant.append(len(msgs) - 1)
    todo = assistant[-1:] if cfg.turns == "last" else assistant
    if todo[0] == 0:
        raise BadRecord("the conversation starts with an assistant turn: nothing to condition it on")
    return Conversation(str(sid), rec, msgs, list(todo))


class RegenOutput:
    """OUTPUT (append-only JSONL, fsynced chunks) and OUTPUT.errors.jsonl; the ids already written."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock, holder = try_lock(path.with_name(path.name + ".lock"))
        if holder:
            raise UsageError(f"{path} is being written by another vx regenerate ({holder})")
        self.done = self._recover()
        self._f = open(path, "ab")
        self.errors = open(path.with_name(path.name + ".errors.jsonl"), "w")
        self._pending: list[bytes] = []
        self._last = time.monotonic()
        self.written = 0

    def _recover(self) -> set[str]:
        """Drop a torn last line (a crash mid-append), return the ids already committed."""
        if not self.path.exists():
            return set()
        data = self.path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]
        if len(keep) < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(keep))
                os.fsync(f.fileno())
        return {str(json.loads(line)["id"]) for line in keep.splitlines() if line.strip()}

    def add(self, record: dict, every: int) -> None:
        self._pending.append(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        if len(self._pending) >= every or time.monotonic() - self._last > 2.0:
            self.commit()

    def commit(self) -> None:
        if self._pending:
            self._f.write(b"".join(self._pending))
            self._f.flush()
            os.fsync(self._f.fileno())
            self.written += len(self._pending)
            self._pending.clear()
            faults.point("after-chunk")
        self._last = time.monotonic()

    def close(self) -> None:
        self.commit()
        self._f.close()
        self.errors.close()
        self._lock.close()


def split_reasoning(text: str, separate: bool) -> dict:
    """The generated text as message fields: thinking in reasoning_content when the template
    renders that field, else kept inline as the model wrote it."""
    if separate and "</think>" in text:
        thinking, _, answer = text.partition("</think>")
        return {"reasoning_content": thinking.replace("<think>", "", 1).strip("\n"), "content": answer.lstrip("\n")}
    return {"content": text}


def _start_engine(cfg: RegenConfig, model_dir: Path):
    """A plain vLLM engine (no capture), prefix caching on; its log in OUTPUT.vllm.log."""
    from .logs import engine_output
    from .vllm_backend import _cpu_env

    with engine_output(cfg.output.with_name(cfg.output.name + ".vllm.log"), cfg.verbose):
        _cpu_env()
        import torch
        from vllm import LLM

        kw = dict(model=str(model_dir), tokenizer=str(model_dir), enable_prefix_caching=True, seed=cfg.seed or 0)
        if not torch.cuda.is_available():
            kw.update(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=cfg.gpu_memory_utilization or 0.3)
        elif cfg.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        for k in ("max_num_seqs", "max_model_len"):
            if getattr(cfg, k):
                kw[k] = getattr(cfg, k)
        return LLM(**kw)


def run_regenerate(cfg: RegenConfig, progress: bool | None = None) -> dict:
    from .model import load_tokenizer, resolve_model
    from .progress import RunProgress
    from .reaper import Reaper
    from .vllm_backend import stop_engine_core, tokens_input

    model_dir = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    template_text = Path(cfg.chat_template).read_text() if cfg.chat_template else None
    chat = ChatTemplate(tokenizer, template_text, cfg.template_kwargs)
    if not chat.available:
        raise UsageError("the model's tokenizer has no chat template; give --chat-template")
    separate = "reasoning_content" in (template_text or getattr(tokenizer, "chat_template", "") or "")
    source = Input(cfg.data, cfg.endpoint_url)
    out = RegenOutput(cfg.output)
    t0 = time.perf_counter()
    reaper = Reaper.start()  # the engine dies with this process, SIGKILL included
    try:
        llm = _start_engine(cfg, model_dir)
    except BaseException:
        reaper.stop()
        out.close()
        raise
    from vllm import SamplingParams  # after the engine start: vLLM's import notices go to its log

    engine = llm.llm_engine
    window = 4 * engine.vllm_config.scheduler_config.max_num_seqs  # conversations read ahead
    bar = RunProgress(source.count(), enabled=progress)
    stats = {"conversations": 0, "turns": 0, "generated_tokens": 0, "truncated": 0, "dropped": 0, "errors": 0,
             "skipped": len(out.done)}
    rows = source.rows()
    active: dict[str, Conversation] = {}
    seen: set[str] = set()

    def params(conv: Conversation):
        seed = None if cfg.seed is None else (cfg.seed + zlib.crc32(f"{conv.id}/{conv.todo[0]}".encode())) % (1 << 31)
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_tokens=cfg.max_tokens, seed=seed)

    def submit(conv: Conversation) -> None:
        k = conv.todo[0]
        text = chat.render(conv.messages[:k], tools_of(conv.record), gen=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        conv.turns.append({"index": k, "prompt_tokens": len(ids)})
        engine.add_request(f"{conv.id}\x00{k}", tokens_input(ids), params(conv))

    def finish(conv: Conversation) -> None:
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

    def refill() -> bool:
        """Read records until `window` conversations are in flight; False when the input is done."""
        while len(active) < window:
            row = next(rows, None)
            if row is None:
                return False
            if row.record is None and row.bad is None:
                continue
            try:
                if row.bad is not None:
                    raise BadRecord(row.bad)
                conv = plan(row.record, row.index, cfg)
                if conv.id in seen:
                    raise BadRecord(f"duplicate id {conv.id!r}")
                seen.add(conv.id)
                if conv.id in out.done:
                    bar.skip(1)
                    continue
                active[conv.id] = conv
                submit(conv)
            except BadRecord as e:
                stats["errors"] += 1
                out.errors.write(json.dumps({"line": row.index, "file": row.file.short, "row": row.row,
                                             "reason": str(e)}) + "\n")
                bar.skip(1)
        return True

    t_gen = time.perf_counter()
    out.commit()  # starts the chunk clock now, not before the engine's start
    try:
        more = refill()
        while active or more:
            for o in engine.step():
                if not o.finished:
                    continue
                sid, _, k = o.request_id.partition("\x00")
                conv = active[sid]
                gen = o.outputs[0]
                conv.messages[int(k)] = {"role": "assistant", **split_reasoning(gen.text, separate)}
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
                more = refill()
        out.commit()
        t_done = time.perf_counter()  # every conversation written and fsynced; the engine's stop is not generation
    finally:
        out.close()
        bar.close()
        with contextlib.suppress(Exception):
            stop_engine_core(engine)
        reaper.stop()
    stats.update(output=str(cfg.output), written=out.written, seconds=round(time.perf_counter() - t0, 2),
                 generate_s=round(t_done - t_gen, 3))
    return stats
