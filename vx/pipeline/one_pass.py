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
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from vx.device import cuda_available
from vx.engine.fast_exit import in_spawned_child
from vx.engine.plan_start import gpu_shares
from vx.errors import UsageError, VxError, raise_if_stopped
from vx.pipeline.regenerated_text import merge_when_complete, text_in_s3
from vx.pipeline.regeneration import LATER, Regeneration, before_stop
from vx.regenerate.output import looks_finished, merge_leftover_parts
from vx.store.format import GENERATION, REGENERATED

in_spawned_child()  # the regeneration's engine core and worker import this module first: their quick exit

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
            # launcher merges the parts once every capture has read its own (vx/pipeline/one_pass_parallel.py)
            "partition_index": cfg.partition_index, "num_partitions": cfg.num_partitions,
            "plan_file": cfg.plan_file, "merge": False}


def regenerated_path(cfg) -> Path:
    """The JSONL this process's regeneration writes and its capture follows."""
    from vx.regenerate.output import part_path

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
    from vx.jobs.extract import engine_lengths, max_model_len_for, prepare_job

    job = job or prepare_job(cfg)
    whole = cfg if plan is not None else replace(cfg, partition_index=None, num_partitions=1)  # no plan: the whole input's
    longest = max_model_len_for(engine_lengths(whole, job, plan), job) or 2  # the input's plan, kept in OUT for reruns
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

        from vx.regenerate.output import parts_dir

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
        from vx.s3_client import parse_s3_url
        from vx.store.s3 import put_file

        put_file(parse_s3_url(cfg.upload), cfg.endpoint_url, path, GENERATION)


def _fetch(cfg, name: str, dest: Path) -> bool:
    """The S3 output's file `name` into dest (a rerun on another machine); False when there is none."""
    from vx.s3_client import make_client, parse_s3_url
    from vx.store.s3 import fetch_file

    return fetch_file(parse_s3_url(cfg.upload), name, dest, make_client(cfg.endpoint_url))


def cpu_layout() -> tuple[tuple[list[int], list[int]] | None, bool]:
    """(the regeneration's cores and the capture's, or None for every core to both; whether the
    capture waits for the regeneration's end). GPU: shared device, following. CPU: every core to
    both, capture after. VX_ONE_PASS_CORES=split (bench/one_pass.py): the cores halved and the
    capture following, the layout measured against it."""
    if cuda_available():
        return None, False
    if os.environ.get("VX_ONE_PASS_CORES") != "split":
        return None, True
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return (cores[:half], cores[half:] or cores), False


def reversed_binding(tensor_parallel_size: int) -> dict[str, str]:
    """The regeneration engine's OpenMP binding when both engines start at once on every core: the
    cores in reverse order. vLLM's CPU worker binds its main thread to the first core of its list
    (GOMP_CPU_AFFINITY for the libgomp it preloads) and sorts any list it is given, so two engines
    starting together import, load and profile on one core while the other idles (bench/one_pass.py
    timelines: ~5 core-s in 5 s). vLLM's "nobind" leaves the binding to GOMP_CPU_AFFINITY, which
    vx/regenerate/engine.py sets for its engine's start only (ENGINE_GOMP): the worker's main thread
    on the last core, its generation on every core. Left alone: a binding the user chose, and
    tensor parallelism (vx/device.py splits the cores)."""
    from vx.regenerate.engine import ENGINE_GOMP

    if tensor_parallel_size > 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return {}
    cores = sorted(os.sched_getaffinity(0), reverse=True)
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", ENGINE_GOMP: " ".join(map(str, cores)),
            "OMP_NUM_THREADS": str(len(cores))}


def pin_env(cores: list[int]) -> dict[str, str]:
    c = ",".join(map(str, cores))
    return {"VX_CPU_CORES": c, "OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": c}


def run_one_pass(cfg, progress: bool | None = None, reporter=None):
    """The one-pass job in this process: the whole input, a launcher's partition (its plan given:
    --data-parallel-size, --ray; vx/pipeline/one_pass_parallel.py routes there) or one
    --partition-index. Returns extraction's Summary, with the regeneration's summary in it."""
    from vx.data.follow import FollowingInput
    from vx.jobs.extract import run_extract

    out = Path(cfg.output)
    alone = not cfg.plan_file  # no launcher (one engine, or --partition-index): what a launcher does once, here
    if cfg.upload and alone:  # the staging in line with S3 before anything is written there
        from vx.s3_client import parse_s3_url
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
    wait = not after_end or (cfg.backend != "hf" and not cfg.partitioned
                             and looks_finished(followed, cfg.data, cfg.endpoint_url))
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


def main(argv: list[str]) -> int:
    """The regeneration's process: `python -m vx.pipeline.one_pass REGEN_CONFIG_JSON`, run as a
    partition worker runs (dies with its launcher, keeps to its cores, JSON events on stdout)."""
    from vx.launch.workers import run_partition_worker
    from vx.regenerate.config import RegenConfig
    from vx.regenerate.run import run_regenerate

    def run(d: dict, events):
        hold, keep = d.pop("hold", False), d.pop("keep", False)
        if LATER in d.values():  # import the engine's modules while the driver plans, then ask
            from vx.regenerate.engine import preload

            preload(d["tensor_parallel_size"], Path(d["output"]))
            line = sys.stdin.readline()
            if not line.strip():
                raise VxError("the one-pass driver stopped before the regeneration could start")
            d = dict(d, **json.loads(line))

        def ready():  # the engine started: the driver may start its own; held, wait for its word
            events.emit("ready")
            if hold and sys.stdin.readline().strip() != "go":
                raise VxError("the one-pass driver stopped before the generation could start")

        return run_regenerate(RegenConfig(**d), reporter=events, ready=ready,
                              before_stop=before_stop(hold, keep, sys.stdin))

    return run_partition_worker(argv, run)


if __name__ == "__main__":
    from vx.errors import leave

    leave(main(sys.argv[1:]))
