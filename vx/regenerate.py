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
already written and regenerates the rest. Bad records go to OUTPUT.errors.jsonl. Partitions
(data parallel, Ray, --partition-index) write parts that are merged into OUTPUT at the end
(vx/regen_output.py); their launchers are in vx/regen_launch.py.
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import faults
from .chat import ChatTemplate, conversation, tools_of
from .errors import UsageError
from .regen_output import RegenOutput, merge_parts, part_path, parts_dir, sidecar
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
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1             # engines on this node (vx/regen_launch.py)
    gpus: list[int] | None = None
    num_partitions: int = 1                 # alone: the partitions one after another on one engine
    partition_index: int | None = None      # run exactly this partition (SLURM arrays and the like)
    ray: bool = False
    ray_address: str | None = None
    max_retries: int = 3
    plan_file: str | None = None            # internal: the partition plan a launcher computed

    def __post_init__(self):
        self.output = Path(self.output)
        if self.turns not in ("all", "last"):
            raise UsageError(f"--turns must be all or last, got {self.turns!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1 or self.commit_every < 1:
            raise UsageError("--temperature >= 0, 0 < --top-p <= 1, --max-tokens >= 1 are required")
        if self.tensor_parallel_size < 1:
            raise UsageError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        from .config import check_scale_out, check_template_options

        self.template_kwargs = check_template_options(self.chat_template, self.chat_template_kwargs)
        if not (self.num_partitions > 1 and self.partition_index is None and self.data_parallel_size == 1
                and not self.ray and self.gpus is None):  # --num-partitions alone: one engine, in turn
            check_scale_out(self)

    @property
    def launcher(self) -> bool:
        """Partitions run by workers this process starts (data parallel, Ray, or in turn)."""
        return self.partition_index is None and (self.ray or self.num_partitions > 1 or self.data_parallel_size > 1)

    def reading(self):
        """The partition plan's weights: each conversation's tokens as `vx extract` reads it (the
        original assistant turns stand in for the lengths the target will write)."""
        from .dataset import Reading

        template = Path(self.chat_template).read_text() if self.chat_template else None
        return Reading(self.messages_field, "text", self.id_field, template,
                       json.dumps(self.template_kwargs, sort_keys=True))

    def to_json(self) -> dict:
        d = asdict(self)
        d["output"] = str(self.output)
        return d


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


def split_reasoning(text: str, separate: bool) -> dict:
    """The generated text as message fields: thinking in reasoning_content when the template
    renders that field, else kept inline as the model wrote it."""
    if separate and "</think>" in text:
        thinking, _, answer = text.partition("</think>")
        return {"reasoning_content": thinking.replace("<think>", "", 1).strip("\n"), "content": answer.lstrip("\n")}
    return {"content": text}


def _start_engine(cfg: RegenConfig, model_dir: Path, log: Path):
    """A plain vLLM engine (no capture), prefix caching on; its log in `log`."""
    from .logs import engine_output
    from .vllm_backend import _cpu_env

    with engine_output(log, cfg.verbose):
        _cpu_env(cfg.tensor_parallel_size)
        import torch
        from vllm import LLM

        kw = dict(model=str(model_dir), tokenizer=str(model_dir), enable_prefix_caching=True, seed=cfg.seed or 0,
                  tensor_parallel_size=cfg.tensor_parallel_size)
        if not torch.cuda.is_available():
            kw.update(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=cfg.gpu_memory_utilization or 0.3)
        elif cfg.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        for k in ("max_num_seqs", "max_model_len"):
            if getattr(cfg, k):
                kw[k] = getattr(cfg, k)
        return LLM(**kw)


def partition_rows(cfg: RegenConfig, source: Input, model_dir: Path):
    """(row filter, rows to do) of this process: every row, or a partition's under the plan."""
    if cfg.partition_index is None:
        return None, source.count()
    import numpy as np

    from .model import model_info
    from .partition import load_or_make_plan

    plan_file = cfg.plan_file or load_or_make_plan(parts_dir(cfg.output), source, model_dir,
                                                   model_info(model_dir).fingerprint, cfg.num_partitions,
                                                   cfg.reading())
    mine = np.load(plan_file) == cfg.partition_index  # [rows]
    return mine, int(mine.sum())


def run_regenerate(cfg: RegenConfig, progress: bool | None = None, reporter=None) -> dict:
    """One process: the whole input, or one partition of it (cfg.partition_index)."""
    from .model import load_tokenizer, resolve_model
    from .progress import RunProgress

    model_dir = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    template_text = Path(cfg.chat_template).read_text() if cfg.chat_template else None
    chat = ChatTemplate(tokenizer, template_text, cfg.template_kwargs)
    if not chat.available:
        raise UsageError("the model's tokenizer has no chat template; give --chat-template")
    separate = "reasoning_content" in (template_text or getattr(tokenizer, "chat_template", "") or "")
    source = Input(cfg.data, cfg.endpoint_url)
    t0 = time.perf_counter()
    mine, total = partition_rows(cfg, source, model_dir)
    part = cfg.partition_index is not None
    path = part_path(cfg.output, cfg.partition_index, cfg.num_partitions) if part else cfg.output
    sidecar(path, ".done").unlink(missing_ok=True)
    out = RegenOutput(path, merged=cfg.output if part else None)
    bar = reporter or RunProgress(total, enabled=progress, label="regenerate")
    stats = {"conversations": 0, "turns": 0, "generated_tokens": 0, "truncated": 0, "dropped": 0, "errors": 0,
             "skipped": 0, "output": str(cfg.output), "partition": cfg.partition_index}

    def todo():
        """The conversations still to regenerate, in input order; bad records reported on the way."""
        seen: set[str] = set()
        for row in source.rows():
            if (row.record is None and row.bad is None) or (mine is not None and not mine[row.index - 1]):
                continue
            try:
                if row.bad is not None:
                    raise BadRecord(row.bad)
                conv = plan(row.record, row.index, cfg)
                if conv.id in seen:
                    raise BadRecord(f"duplicate id {conv.id!r}")
                seen.add(conv.id)
            except BadRecord as e:
                stats["errors"] += 1
                out.errors.write(json.dumps({"line": row.index, "file": row.file.short, "row": row.row,
                                             "reason": str(e)}) + "\n")
                bar.skip(1)
                continue
            if conv.id in out.done:
                stats["skipped"] += 1
                bar.skip(1)
                continue
            yield conv

    try:
        convs = todo()
        first = next(convs, None)  # nothing left to do (a finished partition): no engine to start
        if first is not None:
            stats.update(_generate(cfg, model_dir, tokenizer, chat, separate, first, convs, out, bar, stats))
    finally:
        out.close()
        bar.close()
    if part:
        sidecar(path, ".done").touch()  # every row of the partition is written, skipped or in errors
        stats["merged"] = merge_when_complete(cfg.output, cfg.num_partitions)
    stats.update(written=out.written, seconds=round(time.perf_counter() - t0, 2))
    stats.setdefault("generate_s", 0.0)
    return stats


def merge_when_complete(output: Path, count: int) -> bool:
    """The last partition to finish merges them all into OUTPUT (another one merging: skipped)."""
    if not all(sidecar(part_path(output, i, count), ".done").exists() for i in range(count)):
        return False
    try:
        return merge_parts(output, count)["complete"]
    except UsageError:  # another partition holds the merge lock: it merges
        return False


def _generate(cfg, model_dir, tokenizer, chat, separate, first, convs, out, bar, stats) -> dict:
    """Every conversation in flight in one engine; returns generate_s (first request to last commit)."""
    from .reaper import Reaper
    from .vllm_backend import stop_engine_core, tokens_input

    reaper = Reaper.start()  # the engine dies with this process, SIGKILL included
    try:
        llm = _start_engine(cfg, model_dir, sidecar(out.path, ".vllm.log"))
    except BaseException:
        reaper.stop()
        raise
    from vllm import SamplingParams  # after the engine start: vLLM's import notices go to its log

    engine = llm.llm_engine
    window = 4 * engine.vllm_config.scheduler_config.max_num_seqs  # conversations read ahead
    active: dict[str, Conversation] = {}

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

    t_gen = time.perf_counter()
    out.commit()  # starts the chunk clock now, not before the engine's start
    try:
        more = refill(first)
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
                more = refill(None)
        out.commit()
        t_done = time.perf_counter()  # every conversation written and fsynced; the engine's stop is not generation
    finally:
        with contextlib.suppress(Exception):
            stop_engine_core(engine)
        reaper.stop()
    return {"generate_s": round(t_done - t_gen, 3)}
