#!/bin/bash
# Issue 49's runs on a lent machine of 2 to 8 GPUs (device tool; carry .whl, .cache/tiny and, for `colocated`,
# .cache/baseline-46: see tools/gpu_issue46.sh). Each part logs to $OUT/<part>.log; the script exits non-zero when a
# part failed or missed its target. On one GPU each part runs its one-rank rows (a dry run of the same script).
#   tools/gpu_issue49.sh moe        # megatron EP 2 (and 4) against one rank, a reduced Qwen3-30B-A3B: loss,
#                                   # grad_norm within bf16's tolerance, active-parameter MFU
#   tools/gpu_issue49.sh turns      # multi-turn episodes with long-tailed tool waits, eta 4 vs 0, 3 seeds
#   tools/gpu_issue49.sh async      # single-turn long-tail GRPO, 1.5B shape, eta 4 vs 0, 3 seeds (1 server GPU +
#                                   # 1 trainer GPU)
#   tools/gpu_issue49.sh colocated  # colocated tensor updates on every GPU: shared per GPU (today) against from
#                                   # rank 0 (the package before issue 46), update seconds per step
#   tools/gpu_issue49.sh context    # fsdp c = 2 (and 4) against c = 1 (1.5B, bf16), then a 7B's tokens/s at 32k
#                                   # and 64k tokens a sequence
#   tools/gpu_issue49.sh lora       # a rank-64 7B adapter published to every GPU's server against its merged weights
set -o pipefail
source tools/gpu_env.sh
export AREAL_HPC_TINY=$PWD/.cache/tiny
OUT=${OUT:-/tmp/out}
GPUS=$(nvidia-smi -L | wc -l)
WIDE=$([ "$GPUS" -ge 4 ] && echo 4 || echo 2)  # the widest EP and c sizes this machine runs
status=0

moe() {
  local layouts=megatron:1
  [ "$GPUS" -ge 2 ] && layouts+=,megatron:ep2
  [ "$GPUS" -ge 4 ] && layouts+=,megatron:ep4
  python3 tools/gpu_check_sharded.py --shape 30b-a3b --moe-layers ${MOE_LAYERS:-8} --layouts $layouts \
    --out $OUT/moe.jsonl
}
turns() {
  for seed in 1 2 3; do
    python3 tools/bench_episodes.py --set seed=$seed --set cluster.n_nodes=1 --set cluster.n_gpus_per_node=2 || return 1
  done
}
async() {
  python3 tools/bench_async.py --only long-tail --shape 1.5b --tail-seeds 3 --tail-steps 24 --variants eta0,eta4
}
colocated() {  # 16 x 8 x 1,024 as issue 46's step, the micro-batches of a 80 GB card
  local work="--steps 3 --shape 1.5b --group-size 8 --max-new-tokens 1024 --mem-fraction 0.5 --gpus $GPUS"
  work+=" --set actor_train.mb_spec.max_tokens_per_mb=16384 --set actor_inf.mb_spec.max_tokens_per_mb=16384"
  # from the baseline's folder: its roles (`python -m`) import the package of the working directory
  (cd .cache/baseline-46 && PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_colocated.py $work \
    --json $OUT/colocated-rank0.json) || return 1
  python3 tools/gpu_check_colocated.py $work --json $OUT/colocated-per-gpu.json
}
context() {
  local layouts=fsdp:1
  [ "$GPUS" -ge 2 ] && layouts+=,fsdp:cp2
  [ "$GPUS" -ge 4 ] && layouts+=,fsdp:cp4
  python3 tools/gpu_check_sharded.py --shape 1.5b --layouts $layouts --out $OUT/context.jsonl || return 1
  for len in 32768 65536; do
    python3 tools/gpu_check_sharded.py --shape 7b --offload --gradient-checkpointing --seq-len $len \
      --seqs $WIDE --layouts fsdp:cp$([ "$GPUS" -ge 2 ] && echo $WIDE || echo 1) --out $OUT/context-$len.jsonl \
      || return 1
  done
}
lora() {  # the same LoRA actor publishing its adapter, then its merged weights
  local work="--steps 3 --shape 7b --group-size 8 --max-new-tokens 512 --mem-fraction 0.4 --gpus $GPUS"
  work+=" --set actor.lora.rank=64 --set actor.lora.alpha=128 --set actor.gradient_checkpointing=true"
  python3 tools/gpu_check_colocated.py $work --weight-update-mode adapter --json $OUT/lora-adapter.json || return 1
  python3 tools/gpu_check_colocated.py $work --weight-update-mode tensor --json $OUT/lora-merged.json
}
run_parts "^step |speed-up|vs |OK|FAIL|PROBLEM|check|Error|error" "$@"
exit $status
