#!/bin/bash
# Issue 16's runs on a lent machine of several GPUs (device tool; carry .whl and .cache/tiny). Each part logs to
# $OUT/<part>.log; the script exits non-zero when any part missed its target or failed.
#   tools/gpu_issue16.sh weights sharded     # 2 GPUs: weight sync of a 7B shape; FSDP and Megatron TP/PP beside 1 rank
#   tools/gpu_issue16.sh async               # 2 GPUs: eta 4 interruptible against eta 0, three seeds
#   tools/gpu_issue16.sh sharded recover     # 4 GPUs: 4-rank layouts; the pipeline with a trainer killed
# On one GPU every part is a dry run of the same script (gloo, one-rank layouts, colocated).
set -o pipefail
source tools/gpu_env.sh
GPUS=$(nvidia-smi -L | wc -l)
status=0

weights() {
  if [ "$GPUS" -ge 2 ]; then
    python3 tools/gpu_check_weights.py --large 7b --bucket-mb 256,512,1024,2048 --target-ms 50 --target-fraction 0.85
  else
    python3 tools/gpu_check_weights.py --backend gloo --large 7b --bucket-mb 1024 --publishes 2 --raw-repeats 1
  fi
}
async() {
  python3 tools/bench_async.py --seeds 3 --parallel --tail-steps 24
}
sharded() {  # each engine's one-rank row is the reference of its wider layouts
  case "$GPUS" in
    1) layouts=fsdp:1,megatron:1 ;;
    2|3) layouts=fsdp:1,fsdp:2,megatron:1,megatron:tp2,megatron:pp2 ;;
    *) layouts=fsdp:1,fsdp:4,megatron:1,megatron:2,megatron:tp2pp2 ;;
  esac
  python3 tools/gpu_check_sharded.py --device cuda --shape 1.5b --layouts $layouts
}
recover() {
  if [ "$GPUS" -ge 4 ]; then
    python3 tools/gpu_check_recover.py --kill trainer --shape 0.5b --gpus 4 --steps 10 \
      --allocation builtin.d2p1m1+d1p1m2 --backend megatron
  else
    python3 tools/gpu_check_recover.py --kill trainer --shape 0.5b --gpus 1 --steps 6 \
      --allocation d1p1m1 --set weight_update_mode=disk
  fi
}

for part in "$@"; do
  echo "=== $part on $GPUS GPU(s): $(date -u +%T)"
  SECONDS=0
  "$part" 2>&1 | tee "${OUT:-/tmp}/$part.log" || { status=1; echo "=== $part FAILED"; }
  echo "=== $part took $SECONDS s"
done
exit $status
