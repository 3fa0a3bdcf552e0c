#!/usr/bin/env bash
# One-shot H200 run (device tool): hf-naive vs vx hf-hooks on a random Qwen3.6-27B-shaped model.
# Needs only torch + transformers (>= 5.x, with Qwen3_5) on the GPU machine; no vLLM, no network.
# Writes $OUT/gpu-bench.json (bench/results/ when $OUT is unset). Under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 470 python3 bench/gpu.py
