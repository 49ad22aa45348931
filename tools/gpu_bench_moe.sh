#!/bin/bash
# On the lent H200 (device tool, carry .whl): issue 33's point 5, a Qwen3-30B-A3B shape with MOE_LAYERS of its
# 48 layers (random weights) beside the dense 3B shape, megatron engine, bench_train's workload.
set -o pipefail
source tools/gpu_env.sh
python3 tools/bench_train.py --device cuda --skip-checks --shapes "3b,30b-a3b" --moe-layers "${MOE_LAYERS:-8}" \
  --variants megatron:nockpt --checkpoint none "$@" 2>&1 | grep -v -i warn | tee "$OUT/bench_moe.log"
