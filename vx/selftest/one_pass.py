"""`vx selftest`'s one-pass stage: `vx extract --regenerate` end to end on the selftest's model.

A few conversations of the shapes that matter (one turn, a system prompt, two assistant turns
regenerated in order) go through the real one-pass job (the regeneration's own engine in a child
process, vx's capture engine following its commits), sampled, then every stored conversation is
held against what the job's code does not produce: the tokenizer's own chat template rendering
of the regenerated text (transformers) for the ids, and the HF reference for the states.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "What is a GPU?"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "And one more?"}, {"role": "assistant", "content": "11"}],
    [{"role": "user", "content": "Count to five."}],
]


def check_one_pass(report, cfg, model_dir: Path, info, work: Path, on_gpu: bool) -> None:
    from transformers import AutoTokenizer

    from vx.engine.reference import Reference
    from vx.jobs.config import ExtractConfig
    from vx.jobs.one_pass import run as run_one_pass
    from vx.store.format import REGENERATED
    from vx.store.reader import open_dataset

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if not tok.chat_template:
        report.row("one pass", "skipped: the tokenizer has no chat template (vx extract --regenerate needs one)")
        return
    n = 32 if on_gpu else 8
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"conv-{i:03d}", "messages": PROMPTS[i % len(PROMPTS)]}) + "\n"
                            for i in range(n)))
    out = work / "one-pass"
    ecfg = ExtractConfig(data=str(data), output=out, model=str(model_dir), backend="vllm", layers=list(range(info.num_layers)),
                         regenerate=True, temperature=0.8, top_p=0.95, seed=1, max_tokens=64 if on_gpu else 16,
                         tensor_parallel_size=cfg.tensor_parallel_size, enforce_eager=cfg.enforce_eager,
                         shard_size_mb=0.05)
    t = time.perf_counter()
    s = run_one_pass(ecfg, progress=False)
    wall = time.perf_counter() - t
    convs = [json.loads(line) for line in (out / REGENERATED).read_text().splitlines() if line.strip()]
    ds = open_dataset(out)
    stored = set(ds.ids)
    if sorted(c["id"] for c in convs) != sorted(f"conv-{i:03d}" for i in range(n)) or stored != {c["id"] for c in convs}:
        report.failures.append(f"one pass: {len(convs)} conversations regenerated and {len(stored)} captured of {n}")
    ref = Reference(model_dir, ds.layer_ids, info.model_type)
    worst, drift = (1.0, None), 0
    try:
        for c in convs:
            if c["id"] not in stored:
                continue
            ids = tok(tok.apply_chat_template(c["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
            item = ds[c["id"]]
            if item["input_ids"].tolist() != ids:
                drift += 1
                report.failures.append(f"one pass: {c['id']!r}: stored ids are not the template's rendering of "
                                       "its regenerated conversation")
                continue
            if not (item["hidden_states"].float().abs().amax(dim=(1, 2)) > 0).all():
                report.failures.append(f"one pass: {c['id']!r} has an all-zero row")
            for r in ref.check(c["id"], ids, item["hidden_states"]):
                worst = min(worst, (r["cosine"], f"{c['id']} layer {r['layer']}"))
                if not r["ok"]:
                    report.failures.append(f"one pass: sample {c['id']!r} layer {r['layer']}: cosine "
                                           f"{r['cosine']:.6f}, max |diff| {r['rel_diff']:.3g} x max |ref|")
    finally:
        ref.close()
    g = s.regenerated or {}
    report.row("one pass", f"vx extract --regenerate: {len(convs)} conversations, {g.get('turns', 0)} turns "
                           f"({g.get('generated_tokens', 0):,} tokens at T=0.8) regenerated and captured in "
                           f"{wall:.1f}s; stored ids = the template's rendering for {len(convs) - drift}/{len(convs)}; "
                           f"worst cosine {worst[0]:.6f} ({worst[1]})")
    report.result["one_pass"] = {"conversations": len(convs), "captured": len(stored), "seconds": wall,
                                 "min_cosine": worst[0]}
