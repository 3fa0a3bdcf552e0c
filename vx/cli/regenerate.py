"""`vx regenerate`: the target writes the assistant turns (before `vx extract`)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from . import app
from .options import ModelPath, Progress


@app.command(no_args_is_help=True)
def regenerate(
    data: Annotated[str, typer.Argument(help="Conversations, in any input format `vx extract` reads.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="Output JSONL (appended; rerun to resume).")] = "regen.jsonl",
    model: ModelPath = None,
    turns: Annotated[str, typer.Option(help="all: every assistant turn, in order, on the regenerated history; last: only the final one.")] = "all",
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k sampling (-1: off).")] = -1,
    max_tokens: Annotated[int, typer.Option(help="Longest generated turn; a turn cut here is marked truncated.")] = 1024,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed (per turn: seed + a hash of id and turn).")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file instead of the tokenizer's.")] = None,
    chat_template_kwargs: Annotated[Optional[str], typer.Option(help='JSON object for the template, e.g. \'{"enable_thinking": false}\'.')] = None,
    messages_field: Annotated[str, typer.Option(help="Record field holding the conversation.")] = "messages",
    id_field: Annotated[str, typer.Option(help="Record field holding the id (default: the row number).")] = "id",
    drop_truncated: Annotated[bool, typer.Option(help="Leave out conversations with a turn cut by --max-tokens.")] = False,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vllm: requests per engine step.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vllm: fraction of GPU memory (host memory on CPU).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="vllm: longest prompt + generation.")] = None,
    commit_every: Annotated[int, typer.Option(help="Conversations per fsynced chunk of the output (also at most 2 s apart).")] = 64,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3-compatible endpoint for s3:// inputs.")] = None,
    progress: Progress = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="vLLM's log live on stderr (always in OUTPUT.vllm.log).")] = False,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
):
    """Regenerate the assistant turns with the target model, resumably, for drafter training.

    Examples:

      vx regenerate chats.jsonl -o regen.jsonl --model /models/Qwen3.6-27B

      vx regenerate prompts.parquet -o regen.jsonl --turns last --temperature 0.7 --top-p 0.95 --max-tokens 2048

      vx regenerate chats.jsonl -o regen.jsonl --chat-template-kwargs '{"enable_thinking": false}' && vx extract regen.jsonl -o out/
    """
    from ..regenerate import RegenConfig, run_regenerate

    cfg = RegenConfig(data=data, output=output, model=model, turns=turns, temperature=temperature, top_p=top_p,
                      top_k=top_k, max_tokens=max_tokens, seed=seed, chat_template=chat_template,
                      chat_template_kwargs=chat_template_kwargs, messages_field=messages_field, id_field=id_field,
                      drop_truncated=drop_truncated, max_num_seqs=max_num_seqs,
                      gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                      commit_every=commit_every, endpoint_url=endpoint_url, verbose=verbose)
    s = run_regenerate(cfg, progress=progress)
    if json_summary:
        print(json.dumps(s))
        return
    print(f"output       {s['output']}")
    print(f"regenerated  {s['conversations']:,} conversations ({s['turns']:,} turns, {s['generated_tokens']:,} "
          f"tokens), {s['skipped']:,} already done, {s['errors']:,} bad records")
    print(f"truncated    {s['truncated']:,} conversations" + (f" ({s['dropped']:,} left out)" if s["dropped"] else ""))
    print(f"time         {s['seconds']:.1f}s")
