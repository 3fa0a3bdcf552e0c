"""The HF reference a captured sample is held against: which device and dtype it runs in, and
how close a correct capture must come.

The reference is a per-sample HF forward (batch 1, hooks on the target layers, vx/engine/hf_extractor.py)
on this machine's device. fp32 when it fits in the free memory (weights x 4 bytes, plus room for
one sample's activations), else bf16; the bound follows the reference's dtype, the stored dtype
and the model family, from what correct captures measured here (docs/correctness.md): a bf16
capture scores 0.9999 against an fp32 reference on the dense hybrid models, and HF's own bf16
forward 0.9998; MoE targets flip near-tie expert choices in bf16 (cosine 0.997 and max |diff|
0.40 x max |ref| observed for HF's own bf16 forward); fp8 storage keeps 3 mantissa bits. An off-by-one layer or token, or a batch-dependent mix-up, scores far
below every bound (tested through the VX_FAULT=corrupt-layer failpoint).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

HEADROOM = 1.15        # weights x this, plus ACTIVATION_BYTES, must fit in the free memory
ACTIVATION_BYTES = 2 << 30
MOE_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "mixtral", "deepseek_v3")


@dataclass(frozen=True)
class Bound:
    min_cosine: float     # per sample and layer
    max_rel_diff: float   # max |got - ref| <= this x max |ref|, per sample and layer

    def ok(self, cosine: float, rel_diff: float) -> bool:
        return cosine >= self.min_cosine and rel_diff <= self.max_rel_diff


def bound(model_type: str, ref_dtype: str, store_dtype: str) -> Bound:
    """How close a correct capture comes to the reference (see the module's docstring)."""
    moe = model_type in MOE_TYPES
    if ref_dtype == "float32":
        cos = 0.995 if moe else 0.9995
    else:  # two bf16 computations: both carry bf16's rounding
        cos = 0.99 if moe else 0.999
    rel = 0.04 if not moe else 0.6  # MoE: a flipped expert moves that token's state (HF bf16: 0.40)
    if store_dtype == "fp8":
        cos, rel = min(cos, 0.99), max(rel, 0.1)
    return Bound(cos, rel)


def free_bytes(device: str) -> int:
    """Free memory on the device: the GPU's (call only once no fork follows: it initialises CUDA),
    or the host's MemAvailable on CPU."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def weight_count(model_dir: Path) -> int:
    """Parameters in the checkpoint, from its safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if "visual." in name:  # VL layout: the reference loads text-only
                    continue
                total += _numel(st.get_slice(name).get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def choose(model_dir: Path, device: str | None = None) -> tuple[str, str, str]:
    """(device, dtype, why) of the reference: fp32 when it fits the free memory, else bf16."""
    from vx.device import cuda_available

    device = device or ("cuda" if cuda_available() else "cpu")
    free = free_bytes(device)
    params = weight_count(model_dir)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        need = params * size * HEADROOM + ACTIVATION_BYTES
        if need <= free:
            return device, dtype, f"{dtype} ({params / 1e9:.2f}B parameters need {need / 2**30:.1f} GiB, " \
                                  f"{free / 2**30:.1f} GiB free on {device})"
    from vx.errors import VxError

    raise VxError(f"the HF reference does not fit on {device}: {params / 1e9:.2f}B parameters need "
                  f"{(params * 2 * HEADROOM + ACTIVATION_BYTES) / 2**30:.1f} GiB in bf16, "
                  f"{free / 2**30:.1f} GiB free")


def compare(got: torch.Tensor, ref: torch.Tensor) -> list[tuple[float, float, float]]:
    """Per layer (cosine, max |got - ref|, that / max |ref|) of one sample's [T, L, H] states."""
    got, ref = got.float().cpu(), ref.float().cpu()
    out = []
    for j in range(ref.shape[1]):
        g, r = got[:, j].flatten(), ref[:, j].flatten()
        cos = torch.nn.functional.cosine_similarity(g, r, dim=0).item()
        diff = (g - r).abs().max().item()
        out.append((cos, diff, diff / (r.abs().max().item() or 1.0)))
    return out


class Reference:
    """The HF reference for one model's captured layers, on this machine's device in the dtype
    that fits (choose), with the bound a correct capture meets (bound). check() recomputes one
    sample and holds the captured states against it, layer by layer."""

    def __init__(self, model_dir: Path, layer_ids: list[int], model_type: str, store_dtype: str = "bf16",
                 device: str | None = None):
        from vx.engine.hf_extractor import HFExtractor, load_hf_model

        self.device, self.dtype, self.why = choose(model_dir, device)
        self.bound = bound(model_type, self.dtype, store_dtype)
        self.layer_ids = list(layer_ids)
        self._model = load_hf_model(model_dir, self.dtype, self.device)
        self._extractor = HFExtractor(self._model, self.layer_ids)

    def states(self, sample_id: str, input_ids: list[int]) -> torch.Tensor:
        """The reference states of one sample: [T, L, H]."""
        from vx.data.samples import Sample

        return self._extractor.extract([Sample(sample_id, 0, list(input_ids), [])])[0]

    def check(self, sample_id: str, input_ids: list[int], states: torch.Tensor, ref: torch.Tensor | None = None,
              limit: Bound | None = None) -> list[dict]:
        """states [T, L, H] as captured -> per layer {id, layer, cosine, max_abs_diff, rel_diff, ok}.
        ref: the sample's states() when already computed; limit: another store dtype's bound."""
        ref = self.states(sample_id, input_ids) if ref is None else ref  # [T, L, H]
        limit = limit or self.bound
        return [{"id": sample_id, "layer": k, "cosine": cos, "max_abs_diff": diff, "rel_diff": rel,
                 "ok": limit.ok(cos, rel)}
                for k, (cos, diff, rel) in zip(self.layer_ids, compare(states, ref))]

    def close(self) -> None:
        self._extractor.remove()
        self._model = self._extractor = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def model_type_of(model_dir: Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return (cfg.get("text_config") or cfg).get("model_type", cfg.get("model_type", "?"))
