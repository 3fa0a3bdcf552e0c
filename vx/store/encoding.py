"""How hidden states are stored: dtype encoding and the per-sample checks before commit.

Store dtypes: bf16 (default), fp16, fp32, and fp8 = float8_e4m3fn with one float32 scale per
token per layer (scale = amax / 448), dequantized by the reader to bf16 transparently.
fp8 bound (tested): per token and layer, max |x - dequant(x)| <= amax / 16 (3 mantissa bits:
half an ulp is at most 2^-4 of the value, and no value exceeds amax), i.e. 1 byte instead of 2.
"""

from __future__ import annotations

import torch

STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class SampleRejected(ValueError):
    """A sample's states failed a check; it is recorded in errors.jsonl, never committed."""


def token_flags(hidden: torch.Tensor, lo_hi: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token facts the checks need, computed where the states are (on the GPU before the copy
    to the host, so a batch of samples is checked with a few kernels and only T x (L+1) bools
    cross PCIe). hidden: [T, L, H] -> finite [T] (every value finite), zero [T, L] (all zero).
    One min/max pass (NaN and Inf propagate into it), no [T, L, H] temporaries."""
    lo, hi = lo_hi if lo_hi is not None else torch.aminmax(hidden, dim=2)  # [T, L] each
    finite = torch.isfinite(lo).logical_and_(torch.isfinite(hi)).all(dim=1)
    return finite, (lo == 0).logical_and_(hi == 0)


def flags_problem(finite: torch.Tensor, zero: torch.Tensor) -> str | None:
    """One sample's token flags (host tensors, [T] and [T, L]) -> why it is rejected, or None."""
    if not bool(finite.all()):
        return "hidden states contain NaN or Inf"
    zero_layers = zero.all(dim=0)  # [L]: every token of that layer is zero
    if zero.shape[0] and bool(zero_layers.any()):
        return f"layer positions {zero_layers.nonzero().flatten().tolist()} are all zero"
    return None


def check_states(hidden: torch.Tensor, num_tokens: int) -> None:
    """Finite values, no all-zero layer, one row per token. hidden: [T, L, H]."""
    if hidden.dim() != 3 or hidden.shape[0] != num_tokens:
        raise SampleRejected(f"hidden states have {tuple(hidden.shape)} rows/shape for {num_tokens} tokens")
    problem = flags_problem(*token_flags(hidden))
    if problem:
        raise SampleRejected(problem)


def encode(hidden: torch.Tensor, store_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, L, H] on CPU -> (stored tensor, per-token-per-layer scales [T, L] float32 or None)."""
    return encode_on(hidden.to("cpu"), store_dtype)


def encode_on(hidden: torch.Tensor, store_dtype: str,
              lo_hi: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """encode() on the tensor's own device: on a GPU, fp8 quantisation runs there and halves the
    bytes that cross PCIe. Per-token scales make it row-local, so a batch of samples is encoded
    at once and split afterwards. lo_hi: the [T, L] min and max, if already computed."""
    if store_dtype != "fp8":
        return hidden.to(STORE_DTYPES[store_dtype]).contiguous(), None
    lo, hi = lo_hi if lo_hi is not None else torch.aminmax(hidden, dim=2)
    amax = torch.maximum(hi.float(), lo.float().neg())  # [T, L]
    scales = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = hidden.to(torch.float32, copy=True)  # one fp32 temporary, divided in place (the same
    q.div_(scales.unsqueeze(2))               # IEEE division as x.float() / s, without a second copy)
    return q.to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def prepare(hidden: torch.Tensor, store_dtype: str):
    """Checks' token flags and the stored encoding from one min/max pass: (stored, scales,
    finite [T], zero [T, L]). hidden: [T, L, H] on any device."""
    lo_hi = torch.aminmax(hidden, dim=2)
    return (*encode_on(hidden, store_dtype, lo_hi), *token_flags(hidden, lo_hi))


def decode(stored: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored tensor (+ scales for fp8) -> states; fp8 comes back as bf16, others as stored."""
    if scales is None:
        return stored
    return (stored.to(torch.float32) * scales.unsqueeze(-1)).to(torch.bfloat16)


def bytes_per_token(store_dtype: str, layers: int, hidden: int) -> int:
    """Hidden-state bytes per token (ids and mask add 5)."""
    if store_dtype == "fp8":
        return layers * hidden + 4 * layers
    return layers * hidden * torch.empty(0, dtype=STORE_DTYPES[store_dtype]).element_size()
