"""`vx regenerate`: the target writes the assistant turns (before `vx extract`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Optional

import typer

from vx.cli.app import app
from vx.cli.options import (
    ChatTemplate,
    ChatTemplateKwargs,
    IdField,
    JsonSummary,
    MessagesField,
    MetricsPort,
    ModelPath,
    Progress,
    ProgressEvery,
    with_engines,
    with_generation,
)
from vx.data.generation import Generation


@app.command(no_args_is_help=True, short_help="Regenerate the assistant turns with the target model, resumably.")
@with_engines()
@with_generation()
def regenerate(
    data: Annotated[str, typer.Argument(help="Conversations, in any input format `vx extract` reads.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="Output JSONL (appended; rerun to resume).")] = "regen.jsonl",
    model: ModelPath = None,
    generation: Generation = None,  # --turns ... --drop-truncated (vx/cli/options.py with_generation)
    chat_template: ChatTemplate = None,
    chat_template_kwargs: ChatTemplateKwargs = None,
    messages_field: MessagesField = "messages",
    id_field: IdField = "id",
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vllm: requests per engine step.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vllm: fraction of GPU memory (host memory on CPU).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="vllm: longest prompt + generation.")] = None,
    engines: dict = None,  # --tensor-parallel-size, --dp, --gpus, --ray-address, --max-retries (with_engines)
    num_partitions: Annotated[int, typer.Option(help="Split the conversations into this many token-balanced partitions (the unit of work and of retry; parts in OUTPUT.parts/). Default: one per engine.")] = 1,
    partition_index: Annotated[Optional[int], typer.Option(help="Run only this partition (0-based) of --num-partitions, e.g. a SLURM array task; the last one to finish merges all into OUTPUT.")] = None,
    ray: Annotated[bool, typer.Option(help="Run the partitions as Ray tasks on an existing Ray cluster (OUTPUT and DATA on a filesystem every node shares).")] = False,
    commit_every: Annotated[int, typer.Option(help="Conversations per fsynced chunk of the output (also at most 2 s apart).")] = 64,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint for s3:// inputs.")] = None,
    progress: Progress = None,
    progress_every: ProgressEvery = None,
    metrics_port: MetricsPort = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="vLLM's log live on stderr (always in OUTPUT.vllm.log).")] = False,
    json_summary: JsonSummary = False,
):
    """Regenerate the assistant turns with the target model, resumably, for drafter training.

    Examples:

      vx regenerate chats.jsonl -o regen.jsonl --model /models/Qwen3.6-27B

      vx regenerate prompts.parquet -o regen.jsonl --turns last --temperature 0.7 --top-p 0.95 --max-tokens 2048

      vx regenerate chats.jsonl -o regen.jsonl --chat-template-kwargs '{"enable_thinking": false}' && vx extract regen.jsonl -o out/

      vx regenerate chats.jsonl -o regen.jsonl --model /models/big --dp 8

      vx regenerate chats.jsonl -o /shared/regen.jsonl --num-partitions 16 --partition-index $SLURM_ARRAY_TASK_ID
    """
    from vx.jobs import regenerate as job
    from vx.launch.launcher import launch
    from vx.jobs.config import RegenConfig

    cfg = RegenConfig(data=data, output=output, model=model, chat_template=chat_template,
                      chat_template_kwargs=chat_template_kwargs, messages_field=messages_field, id_field=id_field,
                      **asdict(generation), max_num_seqs=max_num_seqs,
                      gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                      commit_every=commit_every, endpoint_url=endpoint_url, verbose=verbose,
                      num_partitions=num_partitions, partition_index=partition_index, ray=ray,
                      metrics_port=metrics_port, progress_every=progress_every, **engines)
    s = launch(job, cfg, progress=progress)  # in this process, on this node's engine slots, or on Ray
    if json_summary:
        print(json.dumps(s))
        return
    print(f"output       {s['output']}")
    print(f"regenerated  {s['conversations']:,} conversations ({s['turns']:,} turns, {s['generated_tokens']:,} "
          f"tokens), {s['skipped']:,} already done, {s['errors']:,} bad records")
    print(f"truncated    {s['truncated']:,} conversations" + (f" ({s['dropped']:,} left out)" if s["dropped"] else ""))
    for p in s.get("partitions") or []:
        print(f"partition {p['partition']:<3} {p['conversations']:,} conversations, {p['generated_tokens']:,} tokens, "
              f"{p['skipped']:,} already done, finished at {p['finished_s']:.1f}s" + (f" on {p['node']}" if p["node"] else ""))
    if s.get("partition") is not None:
        merged = "all partitions are done: merged into" if s.get("merged") else "merged, when every partition is done, into"
        print(f"partition    {s['partition']} of {cfg.num_partitions}, {merged} {s['output']}")
    print(f"time         {s['seconds']:.1f}s")
