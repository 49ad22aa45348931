#!/bin/bash
# On the lent H200 (device tool, carry .whl): the megatron engine beside the fsdp engine on bench_train's
# workload, 1.5B and 3B shapes, gradient checkpointing off (issue 13, point 5).
set -o pipefail
source tools/gpu_env.sh
python3 tools/bench_train.py --device cuda --skip-checks --shapes "${SHAPES:-1.5b,3b}" \
  --variants "${VARIANTS:-fsdp:nockpt,megatron:nockpt}" --checkpoint none "$@" 2>&1 | grep -v -i warn | tee "$OUT/bench_megatron.log"
