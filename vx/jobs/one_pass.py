"""`vx extract DATA -o OUT --regenerate`: the target writes the assistant turns and vx captures
the final conversations' states, in one command and one run.

The regeneration runs on a plain engine (`vx regenerate`'s, in a child process of this one,
started first: its imports overlap this process's plan) and the capture on vx's engine here. On a
GPU vx's engine starts once the regeneration's has (vLLM sizes its KV cache from the device's free
memory), then prefills each conversation as soon as it is committed, following
OUT/regenerated.jsonl (vx/data/follow.py): generation and capture overlap, one
--gpu-memory-utilization split between the engines by the capture's plan (plan_start.gpu_shares).
On CPU both engines start at once, the generation once vx's engine has started (an engine starting
beside it slowed it by ~30%), and the capture once every conversation is committed: two engines
computing on the same cores stall each other's OpenMP threads (bench/one_pass.py). The
regeneration's engine idles until the capture is done and stops beside vx's (its stop made the
capture ~1.3 s longer beside it). Why not capture during generation on one engine: vLLM's
extract_hidden_states method schedules a draft position per request per decode step: generation
0.22-0.28x as fast on CPU, a 27B target's batch halved on an H200 (docs/performance.md).
The stored rows are the chat template's rendering of each regenerated conversation, tokenized:
exactly what `vx extract OUT/regenerated.jsonl` would store.

Exactly once: the regeneration commits a conversation (fsynced, then OUT/regenerated.jsonl.committed)
before the capture may read it, and the capture commits its states with the shard manifest. A
rerun after a crash anywhere: the regeneration skips the conversations it committed, the capture
skips the ids it committed and captures the rest: every conversation once in both, its states
those of its text.

As the launcher runs it (vx/launch/launcher.py): prepare() once (extraction's, then the generation
options checked and, with -o s3://, the text of what S3 holds states of restored), run() =
run_one_pass for one partition or the whole input, finish() once (the summaries combined and the
partitions' regenerated text merged into OUT/regenerated.jsonl: from the parts on this node, or
from S3's text for Ray tasks on any node).

Over 300 lines: the job's three functions beside the body of one run they share.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from vx.device import cuda_available
from vx.engine.plan_start import gpu_shares
from vx.errors import UsageError, raise_if_stopped
from vx.jobs import extract
from vx.jobs.regenerated_text import merge_when_complete, text_in_s3
from vx.jobs.regeneration import LATER, Regeneration, cpu_layout, pin_env, reversed_binding
from vx.store.text_output import looks_finished, merge_leftover_parts
from vx.store.format import GENERATION, REGENERATED

NAME, LABEL = "one-pass", "extract"
MEMORY_SHARE = 0.15  # of a CPU node's host memory, for all its engines: two engines a slot
SUM = ("conversations", "turns", "generated_tokens", "truncated", "dropped", "errors", "skipped")
GPU_SHARE = 0.45  # each engine's default --gpu-memory-utilization beside an hf capture (or no plan)


def regen_config(cfg) -> dict:
    """The RegenConfig the child runs: vx regenerate's options, from the one-pass config."""
    from vx.data.generation import generation_json

    return {"data": cfg.data, "output": str(Path(cfg.output) / REGENERATED), "model": cfg.model,
            **generation_json(cfg), "chat_template": cfg.chat_template,
            "chat_template_kwargs": cfg.chat_template_kwargs, "messages_field": cfg.messages_field,
            "id_field": cfg.id_field, "max_num_seqs": cfg.max_num_seqs,
            "gpu_memory_utilization": cfg.gpu_memory_utilization, "max_model_len": cfg.max_model_len,
            "endpoint_url": cfg.endpoint_url, "verbose": False, "tensor_parallel_size": cfg.tensor_parallel_size,
            # a partition worker's regeneration writes OUT/regenerated.jsonl.parts/part-i-of-P.jsonl, and the
            # launcher merges the parts once every capture has read its own (finish, below)
            "partition_index": cfg.partition_index, "num_partitions": cfg.num_partitions,
            "plan_file": cfg.plan_file, "merge": False}


def regenerated_path(cfg) -> Path:
    """The JSONL this process's regeneration writes and its capture follows."""
    from vx.store.text_output import part_path

    out = Path(cfg.output) / REGENERATED
    return part_path(out, cfg.partition_index, cfg.num_partitions) if cfg.partitioned else out


TAIL = 16  # the capture engine's max_model_len exceeds the regeneration's by this: a turn cut at the
# regeneration's limit still gets the template's tail after it


def max_model_len(cfg, job=None, plan: Path | None = None) -> int:
    """The regeneration engine's max_model_len when none is given: the longest input conversation
    (its original turns) plus --max-tokens for each assistant turn regenerated, never past the
    model's own (vLLM's default is the model's, 262,144 for Qwen3.6, and a capture engine refuses
    to start where one such request does not fit)."""
    from vx.data.chat import conversation
    from vx.data.inputs import Input
    from vx.jobs.extract import prepare_job
    from vx.launch.plan import engine_lengths, max_model_len_for

    job = job or prepare_job(cfg)
    whole = cfg if plan is not None else replace(cfg, partition_index=None, num_partitions=1)  # no plan: the whole input's
    lengths = engine_lengths(plan, whole.output, job.source, job.model_dir, job.info.fingerprint, whole.reading(),
                             whole.partition_index)  # the input's plan, kept in OUT for reruns
    longest = max_model_len_for(lengths, job.info.max_position_embeddings) or 2
    turns = 1
    if cfg.turns == "all":
        for row in Input(cfg.data, cfg.endpoint_url).rows():
            msgs = (row.record or {}).get(cfg.messages_field) or (row.record or {}).get("conversations")
            if isinstance(msgs, list):
                try:
                    turns = max(turns, sum(m["role"] == "assistant" for m in conversation(msgs)))
                except Exception:
                    continue
    want = longest + turns * cfg.max_tokens + TAIL
    limit = job.info.max_position_embeddings
    return min(want, limit - TAIL) if limit else want


def check_rerun(cfg, out: Path) -> None:
    """The generation options are part of the output (OUT/regenerate.json, and in S3 with -o s3://):
    a rerun continues only with the same ones (--overwrite starts the conversations over, with the
    states)."""
    from vx.data.generation import generation_json
    from vx.store.lock import write_atomically

    opts = dict(generation_json(cfg), **{k: getattr(cfg, k) for k in ("chat_template", "chat_template_kwargs", "model")})
    path = out / GENERATION
    if cfg.overwrite:
        import shutil

        from vx.store.text_output import parts_dir

        for name in (REGENERATED, REGENERATED + ".committed", REGENERATED + ".errors.jsonl", GENERATION):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(parts_dir(out / REGENERATED), ignore_errors=True)
    elif path.exists() or (cfg.upload and _fetch(cfg, GENERATION, path)):
        before = json.loads(path.read_text())
        changed = sorted(k for k in opts if before.get(k) != opts[k])
        if changed:
            raise UsageError(f"{cfg.upload or out} was regenerated with other {', '.join('--' + k.replace('_', '-') for k in changed)} "
                             f"({', '.join(f'{k}={before.get(k)!r}' for k in changed)}); rerun with those, or "
                             "--overwrite to start over")
    write_atomically(path, json.dumps(opts, indent=1) + "\n")
    if cfg.upload:  # from now on the S3 prefix holds this output (a rerun there keeps its staging)
        from vx.store.s3_client import parse_s3_url
        from vx.store.s3 import put_file

        put_file(parse_s3_url(cfg.upload), cfg.endpoint_url, path, GENERATION)


def _fetch(cfg, name: str, dest: Path) -> bool:
    """The S3 output's file `name` into dest (a rerun on another machine); False when there is none."""
    from vx.store.s3_client import make_client, parse_s3_url
    from vx.store.s3 import fetch_file

    return fetch_file(parse_s3_url(cfg.upload), name, dest, make_client(cfg.endpoint_url))


def run_one_pass(cfg, progress: bool | None = None, reporter=None):
    """The one-pass job in this process: the whole input, a launcher's partition (its plan given:
    --data-parallel-size, --ray; vx/launch/launcher.py) or one --partition-index. Returns extraction's Summary, with the regeneration's summary in it."""
    from vx.data.follow import FollowingInput
    from vx.data.inputs import Input
    from vx.jobs.extract import run_extract

    out = Path(cfg.output)
    alone = not cfg.plan_file  # no launcher (one engine, or --partition-index): what a launcher does once, here
    if cfg.upload and alone:  # the staging in line with S3 before anything is written there
        from vx.store.s3_client import parse_s3_url
        from vx.store.output import Output
        from vx.store.s3 import preflight

        preflight(parse_s3_url(cfg.upload), cfg.endpoint_url)  # endpoint, credentials, bucket: one line, first
        Output.of(cfg).reset_or_sync(cfg.overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    followed = regenerated_path(cfg)
    text = text_in_s3(cfg, followed, followed.stem if cfg.partitioned else "all")
    if alone:
        check_rerun(cfg, out)
    if not cfg.partitioned:  # an earlier --dp run's unmerged parts: this run's regeneration counts them done
        merge_leftover_parts(out / REGENERATED)
    if text is not None and not cfg.overwrite:  # before the regeneration reads what its output holds
        if cfg.partitioned:  # into the root's file, which the partition's regeneration counts as done;
            text.restore(out / REGENERATED, (followed,), compact=False)  # other partitions may be writing
        else:  # (leftover parts merged into it above)
            text.restore(followed)
    split, after_end = cpu_layout()
    # following (GPU), or on CPU a finished regeneration's rerun (its child ends, no engine started; the
    # capture then starts one only for work left): the capture waits for the child's engine or its end
    records = lambda: sum(r.record is not None or r.bad is not None for r in Input(cfg.data, cfg.endpoint_url).rows())  # noqa: E731
    wait = not after_end or (cfg.backend != "hf" and not cfg.partitioned and looks_finished(followed, records))
    gen_env = pin_env(split[0]) if split else {} if cuda_available() else reversed_binding(cfg.tensor_parallel_size)
    split_gpu = cuda_available() and cfg.backend != "hf"  # one --gpu-memory-utilization for both engines
    if cuda_available() and cfg.gpu_memory_utilization is None and not split_gpu:
        cfg = replace(cfg, gpu_memory_utilization=GPU_SHARE)
    # the child first: its imports and engine start are the critical path, the plan below is not
    # on CPU it generates once vx's engine has started (an hf capture has no engine start to wait for)
    log = out / "logs" / (f"regenerate-{followed.stem}.log" if cfg.partitioned else "regenerate.log")
    # keep: the capture's engine starts beside the generation (GPU), which keeps its memory until then
    regen = Regeneration(dict(regen_config(cfg), **({"gpu_memory_utilization": LATER} if split_gpu else {})), gen_env,
                         log, hold=after_end and cfg.backend != "hf", keep=not after_end and cfg.backend != "hf")
    cores, env = os.sched_getaffinity(0), dict(os.environ)  # given back after: a caller in this process keeps its own
    try:
        later = {} if cfg.max_model_len else {"max_model_len": max_model_len(cfg)}
        cfg = replace(cfg, max_model_len=cfg.max_model_len or later["max_model_len"])
        if split_gpu:  # by the capture's plan, before either engine starts
            shares = gpu_shares(cfg.model, cfg.layers, cfg.max_model_len + TAIL, cfg.gpu_memory_utilization,
                                cfg.tensor_parallel_size, cfg.max_num_batched_tokens) or (GPU_SHARE, GPU_SHARE)
            later["gpu_memory_utilization"], cfg = shares[0], replace(cfg, gpu_memory_utilization=shares[1])
        if later:
            regen.send_later(later)
        if split:
            os.sched_setaffinity(0, set(split[1]))
            os.environ.update(pin_env(split[1]))
        followed.parent.mkdir(parents=True, exist_ok=True)
        followed.touch()  # the capture's config checks its input exists
        if wait:  # GPU: one engine starting at a time (vLLM sizes its KV cache from the device's
            regen.wait_ready()  # free memory, which an engine starting beside it changes)
        source = FollowingInput(followed, regen.finished, pending=cfg.backend != "hf", after_end=after_end)
        # a capture after the end skips the warm-up: its dummy prefills would run beside the generation
        # on the same cores (CPU runs eager by default: nothing to compile before the first batch)
        s = run_extract(replace(cfg, data=str(followed), regenerate=False, warm_up=not after_end,
                                max_model_len=cfg.max_model_len + TAIL), progress=progress, reporter=reporter,
                        source=source, started=regen.release,  # a held regeneration generates once this engine has started
                        before_publish=text.sync if text is not None else None,  # text in S3 before its states
                        captured=regen.done)  # a held regeneration's engine stops beside this one's
        raise_if_stopped()  # a stop a library swallowed came back as the capture's end: never release then
        regen.release()  # (a capture with nothing left to do starts no engine)
        regen.done()  # (where the capture had no engine to stop)
        regen.wait()  # raises if it failed after its last commit
        if text is not None:  # a launcher finishes the merged file, gathering each partition's bad records from S3
            text.put_errors() if cfg.partitioned else text.finish()
    finally:
        regen.stop()
        os.sched_setaffinity(0, cores)
        os.environ.clear()
        os.environ.update(env)
    s.regenerated = regen.summary
    if cfg.partitioned and alone and s.regenerated is not None:  # --partition-index: the last one merges
        s.regenerated.update(merge_when_complete(cfg))
    elif text is not None and s.regenerated and not cfg.partitioned:
        s.regenerated["output"] = f"{cfg.upload.rstrip('/')}/{REGENERATED}"
    return s


# -- the job as the launcher runs it ---------------------------------------------------------------
run = run_one_pass
worker_config, watch = extract.worker_config, extract.watch  # a partition's worker and the live figures: extraction's


def config(d: dict):
    from vx.jobs.config import ExtractConfig

    return ExtractConfig(**d)


def prepare(cfg):
    """Once, before the workers: extraction's (identity, plan), then the generation options checked
    (OUT/regenerate.json), with -o s3:// the text of what S3 holds states of restored and its
    segments compacted, and both engines' max_model_len. The workers get the config it returns."""
    from vx.store.text_output import parts_dir

    prep = extract.prepare(cfg)
    cfg, out = prep.cfg, Path(prep.cfg.output)
    check_rerun(cfg, out)
    text = text_in_s3(cfg, out / REGENERATED)  # each worker puts its part's text, the launcher the merged file
    if text is not None and not cfg.overwrite:
        text.restore(out / REGENERATED, tuple(parts_dir(out / REGENERATED).glob("part-*.jsonl")))
    if not cfg.max_model_len:  # once, for every worker's two engines
        cfg = replace(cfg, max_model_len=max_model_len(cfg, prep.extra["job"], Path(prep.plan_file)))
    prep.cfg, prep.kept = cfg, "Every committed conversation and shard is kept"
    return prep


def finish(prep, results: dict, t0: float):
    """Once every partition is done: one Summary, and one OUT/regenerated.jsonl (on this node: from
    the parts; on Ray: from S3's text, or the parts on the shared filesystem), its engine logs
    moved to OUT/logs, and the regenerations' sums in the Summary."""
    import shutil

    from vx.engine.lifetime.logs import LOG_DIR
    from vx.store.text_output import merge_parts, parts_dir

    s = extract.finish(prep, results, t0)
    cfg = prep.cfg
    out = Path(cfg.output)
    text = text_in_s3(cfg, out / REGENERATED)
    if text is not None and cfg.ray:
        merged = {"conversations": text.merge_from_s3(), "complete": True}
    else:
        merged = merge_parts(out / REGENERATED, cfg.num_partitions)
        if merged["complete"]:  # what is left there: the parts' commit marks, locks and engine logs
            for log in parts_dir(out / REGENERATED).glob("*.vllm.log"):
                log.replace(out / LOG_DIR / f"regenerate-{log.name.removesuffix('.jsonl.vllm.log')}.vllm.log")
            shutil.rmtree(parts_dir(out / REGENERATED), ignore_errors=True)
            if text is not None:
                text.finish()
    s.regenerated = {k: sum((r.get("regenerated") or {}).get(k, 0) for r in results.values()) for k in SUM}
    where = f"{cfg.upload.rstrip('/')}/{REGENERATED}" if text is not None else str(out / REGENERATED)
    s.regenerated.update(output=where, conversations_in_output=merged["conversations"])
    return s
