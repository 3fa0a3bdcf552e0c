#!/usr/bin/env bash
# One-shot H200 run (device tool) on a random Qwen3.6-27B-shaped model, no network:
#  - HF path (always): hf-naive vs vx hf-hooks, bench/gpu.py -> $OUT/gpu-bench.json (< 8 min)
#  - vLLM path (when vLLM is installed): vx-vllm vs vllm-bare vs vllm-builtin, compiled,
#    load_format=dummy, bench/gpu_vllm.py -> $OUT/gpu-vllm-bench.json (< 9 min)
# Writes to bench/results/ when $OUT is unset.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if python3 -c "import vllm" 2>/dev/null; then
  timeout 560 python3 bench/gpu_vllm.py
else
  echo "vLLM not installed: HF path only" >&2
fi
timeout 470 python3 bench/gpu.py
