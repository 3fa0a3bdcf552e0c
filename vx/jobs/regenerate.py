"""`vx regenerate`: the target writes the assistant turns, before extraction; the job the launcher
runs (vx/launch/launcher.py) over token-balanced partitions on this node's engine slots, on Ray, or
one engine taking them in turn.

Every conversation keeps its system, user and tool turns; its assistant turns are regenerated in
order, each conditioned on the regenerated history (`turns="last"`: only the final one; a
conversation ending in a user turn gets a reply). All conversations are in flight together in
one vLLM engine (continuous batching, prefix caching on: a conversation's next turn shares its
history with the request before it): turn k+1 of a conversation is submitted the moment its
turn k finishes (vx/engine/generator.py).

The output is the `messages` JSONL that `vx extract` reads, ids kept, plus per conversation
`vx_turns`: per regenerated turn its message index, finish_reason and token counts. It is
append-only and committed in fsynced chunks (vx/store/text_output.py); a rerun drops a torn last
line, skips the ids already written and regenerates the rest. Bad records go to
OUTPUT.errors.jsonl.

prepare() computes the partition plan once (vx/launch/plan.py, weights: each conversation's tokens
as `vx extract` reads it); run() = run_regenerate of one partition, writing
OUTPUT.parts/part-i-of-P.jsonl, resumable; finish() merges the parts into OUTPUT once all are done.
A failed partition is reported when the others are done; rerunning the same command redoes only
what no part records.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from vx.data.chat import ChatTemplate, conversation
from vx.data.formats import BadRecord
from vx.data.generation import Conversation
from vx.data.inputs import Input
from vx.errors import UsageError
from vx.jobs.config import RegenConfig
from vx.store.text_output import RegenOutput, merge_parts, part_path, parts_dir, sidecar

NAME, LABEL = "regenerate", "regenerate"
MEMORY_SHARE = 0.3  # of a CPU node's host memory, for all its engines
SUM = ("conversations", "turns", "generated_tokens", "truncated", "dropped", "errors", "skipped")


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


def plan_file(cfg: RegenConfig, source: Input, model_dir: Path) -> Path:
    """The partition plan of this input and --num-partitions (under OUTPUT.parts/, made once)."""
    from vx.data.model import model_info
    from vx.launch.plan import load_or_make_plan

    return load_or_make_plan(parts_dir(cfg.output), source, model_dir, model_info(model_dir).fingerprint,
                             cfg.num_partitions, cfg.reading())


def partition_rows(cfg: RegenConfig, source: Input, model_dir: Path):
    """(row filter, rows to do) of this process: every row, or a partition's under the plan."""
    if cfg.partition_index is None:
        return None, source.count()
    import numpy as np

    mine = np.load(cfg.plan_file or plan_file(cfg, source, model_dir)) == cfg.partition_index  # [rows]
    return mine, int(mine.sum())


def run_regenerate(cfg: RegenConfig, progress: bool | None = None, reporter=None, ready=None,
                   before_stop=None) -> dict:
    """One process: the whole input, or one partition of it (cfg.partition_index). ready(): called
    once the engine has started, before its first request; before_stop(): once every conversation
    is committed, before the engine stops (the one-pass job sequences its engines)."""
    from vx.data.model import load_tokenizer, resolve_model
    from vx.monitor.progress import RunProgress

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
    bar = reporter or RunProgress(total, enabled=progress, label="regenerate", every=cfg.progress_every)
    stats = {"conversations": 0, "turns": 0, "generated_tokens": 0, "truncated": 0, "dropped": 0, "errors": 0,
             "skipped": 0, "output": str(cfg.output), "partition": cfg.partition_index}
    bar.meter.total = total
    metrics = watch_regeneration(bar, cfg, stats)

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

    state = "failed"
    try:
        convs = todo()
        first = next(convs, None)  # nothing left to do (a finished partition): no engine to start
        if first is not None:
            from vx.engine.generator import generate

            stats.update(generate(cfg, model_dir, tokenizer, chat, separate, first, convs, out, bar, stats,
                                  ready, before_stop))
        state = "done"
    finally:
        out.close()
        bar.close(state)
        if metrics is not None:
            metrics.close()
    if part:
        sidecar(path, ".done").touch()  # every row of the partition is written, skipped or in errors
        stats["merged"] = merge_when_complete(cfg.output, cfg.num_partitions) if cfg.merge else False
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


def watch_regeneration(bar, cfg: RegenConfig, stats: dict | None, engines: int = 1):
    """The live figures of a regeneration: MFU of decode over the whole model (2 FLOPs per weight
    per generated token), device memory, bad records; --metrics-port. Returns the server or None."""
    from vx.data.model import resolve_model
    from vx.monitor.flops import mfu_terms
    from vx.monitor.metrics import serve_metrics
    from vx.monitor.probe import DeviceProbe

    terms = mfu_terms(resolve_model(cfg.model), None, engines, cfg.tensor_parallel_size)
    m = bar.meter
    m.flops_per_token, m.peak_flops = terms["flops_per_token"], terms["peak_flops"]
    m.sources.append(DeviceProbe())
    if stats is not None:
        m.sources.append(lambda: {"bad_records": stats["errors"]})
    server = serve_metrics(cfg.metrics_port, "regenerate")
    if server is not None and stats is not None:  # a launcher's (stats None) is fed by its Tally
        bar.add_sink(server.update)
    return server


run = run_regenerate


def config(d: dict) -> RegenConfig:
    return RegenConfig(**d)


def prepare(cfg: RegenConfig):
    """The partition plan and its rows per partition, once for every worker."""
    import numpy as np

    from vx.data.inputs import Input
    from vx.data.model import resolve_model
    from vx.launch.job import Prepared

    path = plan_file(cfg, Input(cfg.data, cfg.endpoint_url), resolve_model(cfg.model))
    plan = np.load(path)
    lines = [int((plan == p).sum()) for p in range(cfg.num_partitions)]
    return Prepared(cfg, str(path), lines, sum(lines), parts_dir(cfg.output),
                    f"Every committed conversation is kept in {parts_dir(cfg.output)}")


def absolute(path: str | None) -> str | None:
    """A local path (or glob) made absolute: a Ray task runs in another directory. URLs as given."""
    if path is None or "://" in path:
        return path
    return str(Path(path).expanduser().absolute())


def worker_config(prep, index: int, plan_file: str | None, cpu_share: float | None, portable: bool = False) -> dict:
    cfg = prep.cfg
    child = replace(cfg, data_parallel_size=1, gpus=None, ray=False, ray_address=None, partition_index=index,
                    plan_file=plan_file, output=cfg.output.resolve(), data=absolute(cfg.data),
                    model=absolute(cfg.model), chat_template=absolute(cfg.chat_template),
                    metrics_port=None, progress_every=None,  # the launcher serves the metrics
                    merge=False)  # and merges the parts once every worker is done (none merges beside another's start)
    if child.gpu_memory_utilization is None and cpu_share is not None:
        child.gpu_memory_utilization = round(cpu_share, 3)
    return child.to_json()


def watch(bar, prep, engines: int):
    return watch_regeneration(bar, prep.cfg, None, engines=engines)


def finish(prep, results: dict, t0: float) -> dict:
    cfg = prep.cfg
    merged = merge_parts(cfg.output, cfg.num_partitions)
    summary = {k: sum(r[k] for r in results.values()) for k in SUM}
    summary.update(output=str(cfg.output), conversations_in_output=merged["conversations"],
                   seconds=round(time.perf_counter() - t0, 2),
                   partitions=[{"partition": i, **{k: r[k] for k in ("conversations", "generated_tokens", "skipped")},
                                "node": r.get("node"), "finished_s": r["finished_s"]} for i, r in sorted(results.items())])
    return summary
