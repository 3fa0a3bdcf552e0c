"""Useful FLOPs per token of a checkpoint, the numerator of MFU.

2 FLOPs per weight a token meets, over the decoder layers up to the last captured one (the
layers whose output the user asked for; vLLM runs the rest, which MFU does not credit), read from
the safetensors headers (no weights are loaded). MoE expert weights count at the routed share
(experts per token / experts); embeddings, the LM head and vision tower are left out, and so is
attention's context term (4 x context x heads x head_dim per attention layer per token, under 10%
at ~335-token samples): a conservative MFU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def flops_per_token(model_dir: Path, upto_layer: int | None = None) -> float:
    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    experts = text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts")
    routed = text.get("num_experts_per_tok")
    share = routed / experts if experts and routed else 1.0
    total = 0.0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                m = _LAYER.search(name)
                if m is None or "visual" in name or "vision" in name or "mtp" in name:
                    continue
                if upto_layer is not None and int(m.group(1)) > upto_layer:
                    continue
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= int(d)
                total += n * (share if ".experts." in name and "shared" not in name else 1.0)
    return 2.0 * total


def mfu_terms(model_dir, layer_ids: list[int] | None, engines: int = 1, tensor_parallel_size: int = 1) -> dict:
    """{"flops_per_token", "peak_flops", "peak"} for MFU of `engines` engines of
    `tensor_parallel_size` GPUs each (on CPU: the cores this process may use); None where unknown.
    layer_ids None: every layer (a regeneration's decode runs the whole model)."""
    import os

    from vx.monitor.peak import peak_flops

    try:
        fpt = flops_per_token(model_dir, max(layer_ids) if layer_ids else None)
    except Exception:
        fpt = None
    peak, what = peak_flops(engines * tensor_parallel_size, cpu_cores=len(os.sched_getaffinity(0)))
    return {"flops_per_token": fpt, "peak_flops": peak, "peak": what}
