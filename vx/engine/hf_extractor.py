"""HF transformers backend: forward hooks on the target layers only, length-sorted padded batches.

Never `output_hidden_states=True` (it keeps every layer alive: 65 x 128 x 3316 x 5120 x 2 B =
280 GB at batch 128). The decoder stack is called directly (no LM head) and the forward is cut
short by an exception right after the last target layer, so later layers and the final norm
never run. Batches are right-padded with an attention mask; padding leaves the real tokens'
states unchanged for both GDN and attention layers (tested). Several samples are never packed
into one row: that is not safe for GDN layers without varlen kernels. run_hf is the
`vx extract --backend hf` job's loop, as vllm_extractor.run_vllm is vLLM's.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Iterator

import torch

from vx import faults
from vx.data.samples import Sample
from vx.device import cpu_has_bf16, cuda_available
from vx.errors import UsageError, imports_over, raise_if_stopped, startup_over

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _StopForward(Exception):
    """Raised by the last target layer's hook: nothing after it needs to run."""


def length_sorted_batches(samples: Iterable[Sample], batch_size: int, max_batch_tokens: int,
                          sort_window: int, min_padding_efficiency: float = 0.95) -> Iterator[list[Sample]]:
    """Sort each window of `sort_window` samples by length (longest first) and cut it into
    batches of at most `batch_size` samples and `max_batch_tokens` padded tokens, in which real
    tokens are at least `min_padding_efficiency` of the padded ones."""
    window: list[Sample] = []
    for s in samples:
        window.append(s)
        if len(window) >= sort_window:
            yield from _cut(window, batch_size, max_batch_tokens, min_padding_efficiency)
            window = []
    if window:
        yield from _cut(window, batch_size, max_batch_tokens, min_padding_efficiency)


def _cut(window: list[Sample], batch_size: int, max_batch_tokens: int, min_eff: float) -> Iterator[list[Sample]]:
    window.sort(key=len, reverse=True)
    batch: list[Sample] = []
    real = 0
    for s in window:
        if batch:
            longest = len(batch[0])
            padded = longest * (len(batch) + 1)
            if len(batch) >= batch_size or padded > max_batch_tokens or (real + len(s)) < min_eff * padded:
                yield batch
                batch, real = [], 0
        batch.append(s)
        real += len(s)
    if batch:
        yield batch


def decoder_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(decoder stack, its layer list) of a *ForCausalLM model."""
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(f"cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return base, layers


def load_hf_model(path, dtype: str = "auto", device: str | None = None):
    """The text decoder of a local checkpoint; VL-layout checkpoints load text-only (vision weights
    under model.visual.* are not loaded). dtype auto: the checkpoint's, except on a CPU without
    bf16 instructions, where it computes in float32 (exact, and several times faster there than
    emulated bf16); the stored dtype is --store-dtype's either way."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    imports_over()  # the collection once the model is loaded passes over the load's objects only
    device = device or ("cuda" if cuda_available() else "cpu")
    if dtype == "auto" and device == "cpu" and not cpu_has_bf16():
        dtype = "float32"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES.get(dtype, "auto"),
                                                 device_map=device if device != "cpu" else None)
    model.config.use_cache = False
    startup_over()  # the model is loaded: a vx process's start-up is over (vx.errors.quiet_startup)
    raise_if_stopped()  # a stop its finalizers swallowed
    return model.eval()


class HFExtractor:
    """Captures the residual stream after each target layer for a batch of samples."""

    def __init__(self, model, layer_ids: list[int], pad_id: int = 0):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.pad_id = pad_id
        self.base, layers = decoder_layers(model)
        self.device = next(model.parameters()).device
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        last = max(self.layer_ids)
        for k in self.layer_ids:
            self._handles.append(layers[k].register_forward_hook(self._hook(k, stop=(k == last))))

    def _hook(self, k: int, stop: bool):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output  # [B, S, H]
            if stop:
                raise _StopForward
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @torch.inference_mode()
    def extract(self, batch: list[Sample]) -> list[torch.Tensor]:
        """-> one tensor [T_i, L, H] per sample, in the model's dtype, on the model's device."""
        lengths = [len(s) for s in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            input_ids[i, : lengths[i]] = torch.tensor(s.input_ids, dtype=torch.long)
            attention_mask[i, : lengths[i]] = 1
        self._captured.clear()
        try:
            self.base(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                      use_cache=False)
        except _StopForward:
            pass
        missing = [k for k in self.layer_ids if k not in self._captured]
        if missing:
            raise RuntimeError(f"target layers {missing} were not reached by the forward pass")
        stacked = torch.stack([self._captured[k] for k in self.layer_ids], dim=2)  # [B, S, L, H]
        self._captured.clear()
        return [stacked[i, :n] for i, n in enumerate(lengths)]  # [T_i, L, H] each


def run_hf(cfg, model_dir, layer_ids, tokenizer, samples, writer, bar, t0):
    """The `vx extract --backend hf` job: samples in length-sorted batches through the HF model into
    writer; returns (load_s, warmup_s, extract_s, samples, tokens)."""
    model = load_hf_model(model_dir, cfg.dtype, cfg.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    extractor = HFExtractor(model, layer_ids, pad_id=pad)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = tokens = 0
    for batch in length_sorted_batches(samples, cfg.batch_size, cfg.max_batch_tokens, cfg.sort_window):
        raise_if_stopped()
        for s, h in zip(batch, extractor.extract(batch)):
            writer.add(s.id, s.input_ids, s.loss_mask, h, line=s.line)
        faults.point("after-batch")
        batch_tokens = sum(len(s) for s in batch)
        n, tokens = n + len(batch), tokens + batch_tokens
        bar.advance(len(batch), batch_tokens, writer.added_bytes)
    writer.close()
    rejected = {sid for sid, _ in writer.rejected}
    return load_s, 0.0, time.perf_counter() - t1, n - len(rejected), tokens
