#!/usr/bin/env bash
# One command on one GPU machine (the device tool), no network, under 10 minutes on one H200:
#  1. vx selftest on a random Qwen3.6-27B-shaped model (its config with 4 layers, real hidden size
#     and vocabulary; compiled, CUDA graphs): vLLM contract, capture of every sample vs the fp32 HF
#     reference, bare vLLM prefill vs vx -> $OUT/selftest.txt, $OUT/selftest.json   (< 5 min)
#  2. with the time left: hf-naive vs vx hf-hooks, bench/gpu.py -> $OUT/gpu-bench.json
#  (between 1 and 2, speculators installed: docs/speculators.md's recipe on the embedded default,
#   extract -> export -> speculators train, 10 steps -> $OUT/speculators-train.txt)
# Writes to bench/results/tmp/ when $OUT is unset. Exit status: the selftest's.
# VX_BENCH_SMOKE=1: the tiny config on CPU, to check this script's own logic.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
export OUT=${OUT:-bench/results/tmp}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET=${VX_GPU_BUDGET_S:-570}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
MODEL=$(mktemp -d /tmp/vx-27b-config.XXXX)
"$PY" - "$MODEL" <<'PY'
import os, sys
sys.path.insert(0, "bench")
from gpu import qwen36_27b_config
from vx.data.tiny import build_tokenizer, tiny_text_config
tokenizer = build_tokenizer(sys.argv[1])
config = tiny_text_config(tokenizer) if os.environ.get("VX_BENCH_SMOKE") == "1" else qwen36_27b_config()
config.max_position_embeddings = 262144  # Qwen3.6's own
config.architectures = ["Qwen3_5ForCausalLM"]
config.save_pretrained(sys.argv[1])  # no weights: vx selftest builds a 4-layer random model of this config
PY
timeout 300 "$PY" -m vx selftest --model "$MODEL" --report "$OUT/selftest.json" 2>&1 | tee "$OUT/selftest.txt"
rc=${PIPESTATUS[0]}
rm -rf "$MODEL"
if "$PY" -c "import speculators" 2>/dev/null && [ "$(left)" -gt 240 ] && [ "${VX_BENCH_SMOKE:-0}" != 1 ]; then
  # docs/speculators.md's recipe end to end on the embedded default: extract, export, speculators train
  S=$(mktemp -d /tmp/vx-spec.XXXX)
  VERIFIER=$("$PY" -c "from vx.data.tiny import default_model_dir; print(default_model_dir())")
  timeout 200 bash -c "set -e
    '$PY' -m vx extract examples/chat.jsonl -o '$S/out' --layers speculators-dflash
    '$PY' -m vx export '$S/out' --to speculators -o '$S/index' --json > '$S/export.json'
    '$PY' -m vx.train.speculators train --data-path '$S/index' --hidden-states-backend vx --on-missing skip \
      --verifier-name-or-path '$VERIFIER' --speculator-type dflash \
      --target-layer-ids \$('$PY' -c \"import json; print(*json.load(open('$S/export.json'))['target_layer_ids'])\") \
      --save-path '$S/ckpt' --epochs 1 --max-steps 10 --total-seq-len 1024 --log-freq 1" > "$OUT/speculators-train.txt" 2>&1
  echo "speculators recipe: exit $?" | tee -a "$OUT/speculators-train.txt" >&2
  rm -rf "$S"
fi
if [ "$(left)" -gt 90 ]; then
  VX_BENCH_DEADLINE_S=$(( $(left) - 45 )) timeout "$(left)" "$PY" bench/gpu.py
fi
echo "bench/gpu.sh: selftest exit $rc, $(( $(date +%s) - START )) s in all" >&2
exit "$rc"
