"""`vx export`: make an output readable by another trainer, without copying its states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from vx.cli.app import app


@app.command(no_args_is_help=True, short_help="Index an output for speculators' trainer (no state is copied).")
def export(
    output: Annotated[str, typer.Argument(help="An extraction output: a directory or s3://bucket/prefix.")],
    to: Annotated[str, typer.Option("--to", help="The trainer: speculators.")] = "speculators",
    dest: Annotated[Path, typer.Option("--output", "-o", help="Where the index goes (a new directory).")] = Path(
        "speculators-data"),
    target_layers: Annotated[Optional[str], typer.Option(
        help="vx layer ids the drafter targets (default: every stored layer but the last, N-1, which is the "
             "verifier's last hidden state and always handed out last).")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(
        help="S3-compatible endpoint for an s3:// output (kept in the index for the backend).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
):
    """Index an output for speculators (`--to speculators`): its Arrow dataset (input_ids, loss_mask,
    seq_len) and the file that points vx's hidden-states backend at OUTPUT. No state is copied:
    from S3, only each shard's ids and masks are read (ranged GETs), and training reads the states
    through a bounded, sha256-checked cache (--vx-cache-gb, --vx-cache-dir).

    Train with speculators' own command, vx's backend registered:

      vx-speculators train --data-path DEST --hidden-states-backend vx --on-missing skip
      --target-layer-ids <printed> --verifier-name-or-path MODEL --speculator-type dflash ...

    (docs/speculators.md has the whole recipe.)

    Examples:

      vx extract chats.jsonl -o out/ --model /models/Qwen3.6-27B --layers speculators-dflash

      vx export out/ --to speculators -o spec-data/

      vx export s3://bucket/run1 --to speculators -o spec-data/
    """
    from vx.data.layers import parse_layer_ids
    from vx.errors import UsageError

    if to != "speculators":
        raise UsageError(f"--to {to!r}: vx exports to speculators")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} exists and is not empty")
    target = parse_layer_ids(target_layers)
    if isinstance(target, str):
        raise UsageError("--target-layers takes layer ids, not a preset")
    from vx.train.speculators_index import export as run_export

    if not output.startswith("s3://") and not Path(output).is_dir():
        raise UsageError(f"{output} is not a directory")
    r = run_export(output, dest, target, endpoint_url)
    if json_out:
        print(json.dumps(r))
        return
    ids = " ".join(map(str, r["target_layer_ids"]))
    print(f"{r['rows']:,} rows, {r['tokens']:,} tokens -> {dest} (states stay in {r['output']})")
    print(f"vx layers {r['layer_ids']} (the last: the verifier's last hidden state)")
    print(f"train: vx-speculators train --data-path {dest} --hidden-states-backend vx --target-layer-ids {ids} "
          f"--on-missing skip --verifier-name-or-path {r['model'] or 'MODEL'} --speculator-type dflash")
