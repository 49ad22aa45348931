#!/bin/bash
# Issues 46's, 47's and 48's runs on one lent GPU (device tool; carry .whl (peft and accelerate among them), .cache/tiny and .cache/baseline-46, the package before
# issue 46 with today's tools:
#   mkdir -p .cache/baseline-46 && git archive 9dd158c areal_hpc tools configs | tar -x -C .cache/baseline-46 \
#     && cp tools/gpu_check_colocated.py tools/bench_train.py .cache/baseline-46/tools/
# Each part logs to $OUT/<part>.log; each run writes $OUT/<part>-<label>.json and, for today's code, its trace.
# On the device tool: `bash tools/gpu_call.sh <seconds, under the device time left> PART...` (BACK, the tool's
# $OUT, gets r.tgz, all of /tmp/out, after each part: what finished comes back from a call that is killed).
#   tools/gpu_issue46.sh step        # the issue-32 step (1.5B, 16 x 8 x 1,024, tensor mode): baseline, today's
#   tools/gpu_issue46.sh overhead    # today's with logging.timeline off (step-today has it on)
#   tools/gpu_issue46.sh loglinear   # prox_logp_method loglinear (no recompute pass) against recompute
#   tools/gpu_issue46.sh profile     # step 2 under torch.profiler, joined to the trace (trace --cuda)
#   tools/gpu_issue46.sh decode      # the step's rollout alone (128 rows x 1,024): baseline's engine, today's profiled
#   tools/gpu_issue46.sh paged       # the paged decode kernel (tools/gpu_check_paged.py) at the step's shape too
#   tools/gpu_issue46.sh kernels     # the decode kernels' GPU tests (the rotary cache write, the engine's logprobs)
#   tools/gpu_issue46.sh sampling    # a decode step's sampling (tools/bench_sampling.py) against the baseline's
#   tools/gpu_issue46.sh 3b 7b       # the same step at the 3B shape, and the 7B with optimizer offload
#   tools/gpu_issue46.sh offload     # the offloaded optimizer's 7B step (tools/bench_offload.py) against b620a9c's
#   tools/gpu_issue46.sh memory      # GPU tests: the offloaded optimizer's moments stay in page-locked memory, and a
#                                    # colocated trainer leaves nothing cached for the servers after a step
#   tools/gpu_issue46.sh lora lora7b # issue 47: tools/gpu_check_lora.py at 7B; the 7B step with a rank-64 adapter
#   tools/gpu_issue46.sh attention   # issue 48: causal attention's kernels at 8k-64k (tools/bench_attention.py), and
#                                    # the GPU check of the trainer's cuDNN path for long sequences
#   tools/gpu_issue46.sh long        # issue 48: tools/bench_long.py, the longest sequence per shape at c = 1
set -o pipefail
source tools/gpu_env.sh
export AREAL_HPC_TINY=$PWD/.cache/tiny
OUT=${OUT:-/tmp/out}
BASE=.cache/baseline-46
WORK="--steps ${STEPS:-3} --group-size 8 --max-new-tokens 1024 --mem-fraction 0.5"
# The 1-GPU colocated recipe's micro-batches (configs/qwen3-1.7b-8gpu.yaml), not the CPU toy's 4,096 tokens; an
# H100 (80 GB) holds the 1.5B trainer's activations of bench_train's 16,384 tokens, not 30,720.
GIB=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
TOKENS=$([ "$GIB" -ge 100 ] && echo 30720 || echo 16384)
MB="--set actor_train.mb_spec.max_tokens_per_mb=$TOKENS --set actor_inf.mb_spec.max_tokens_per_mb=$TOKENS"
status=0
rm -rf /tmp/gpu-colocated-* /tmp/bench-*  # what a run cut off by its time limit left on a warm machine's disk
check() {  # label, code dir, args...: run from the code's folder. The roles start as `python -m`, which puts
  # the working directory on sys.path before PYTHONPATH: from the repository's root, the baseline's roles had
  # run today's package (until 2026-12-06, every step-baseline).
  local label=$1 code=$2; shift 2
  (cd $code && PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_colocated.py $WORK "$@" --json $OUT/$label.json)
}
step() {
  check step-baseline $BASE --shape 1.5b $MB
  check step-today . --shape 1.5b $MB
  python3 tools/trace_rollout.py $OUT/step-today.trace.json  # the server's side of each rollout
}
overhead() {  # against step-today, the same run with the timeline on (its default)
  check overhead-off . --shape 1.5b $MB --set logging.timeline=false
}
loglinear() {
  check loglinear . --shape 1.5b $MB --set ppo.use_decoupled_loss=true --set ppo.prox_logp_method=loglinear
  check recompute . --shape 1.5b $MB --set ppo.use_decoupled_loss=true --set ppo.recompute_logprob=true
}
profile() {
  check profile . --shape 1.5b $MB --set logging.profile_step=2
}
decode() {  # the rollout's shape (16 x 8 answers of 1,024 after 256-token prompts) against the baseline's
  # engine, and today's kernels by time
  python3 tools/bench_gen.py --device cuda --shapes 1.5b --rows 128 --max-new-tokens 1024 \
    --baseline $BASE/areal_hpc/gen/backends/builtin --baseline-tokens 1024 \
    --mem-fraction-static 0.5 --profile $OUT/decode-trace.json --out $OUT/decode.json
}
# Recover checkpoints off: three of a 3B (12 bytes a parameter) need 111 GB, the lent machine's disk holds 64.
kernels() {  # the fused rotary cache write, and the engine's logprobs with it (before a step relies on it)
  python3 -m pytest -q -m gpu tests/test_gpu.py -k "rotary or logprobs_graphs"
}
attention() {  # issue 48: which kernel at 32k, and the long sequences on cuDNN against FlashAttention
  python3 tools/bench_attention.py --out $OUT/attention.jsonl
  python3 -m pytest -q -m gpu tests/test_gpu.py -k cudnn
}
memory() { python3 -m pytest -q -m gpu tests/test_gpu.py -k "offloaded or leaves_nothing_cached"; }
paged() { python3 tools/gpu_check_paged.py; }  # the decode kernel's splits sweep, the step's shape among them
sampling() {  # a decode step's sampling at 128 rows of Qwen's vocabulary, against the baseline's; its kernel checked
  python3 -m pytest -q -m gpu tests/test_gpu.py -k "rotary or sampling_kernel or more_stop_ids or logprobs_graphs or captured_once"
  python3 tools/bench_sampling.py --baseline $BASE/areal_hpc/gen/backends/builtin/sampling.py --out $OUT/sampling.json
}
3b() {  # an H100 runs the 3B trainer out of memory at 16,384 tokens without checkpointing (75 GiB in use)
  check 3b . --shape 3b $MB --set recover_mode=disabled --set actor.gradient_checkpointing=$([ "$GIB" -ge 100 ] && echo false || echo true)
}
offload() {  # the optimizer step alone at 7B: moments in and out on copy streams beside the updates, against
  # b620a9c's, which queued both on the compute stream (git show b620a9c:<offload.py> > $BASE/offload_b620a9c.py)
  python3 -m pytest -q -m gpu tests/test_gpu.py -k "offloaded"
  PYTHONPATH=/tmp/site:$PWD python3 tools/bench_offload.py --baseline $BASE/offload_b620a9c.py --json $OUT/offload.json
}
7b() {  # two steps: a 7B step takes ~4x the 1.5B's
  check 7b . --shape 7b $MB --steps 2 --set actor.optimizer.offload=true --set actor.gradient_checkpointing=true \
    --set recover_mode=disabled
}
# Issue 47: the built-in engine's adapters (publication bytes and seconds, logprobs, side-path cost), and the
# 7B step with a rank-64 adapter published as a PEFT folder (weight_update_mode adapter).
lora() { PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_check_lora.py --shape 7b --rank 64 --out $OUT/lora-check.json; }
lora7b() {  # recompilations logged: step 1's first forward and backward took 78 s against 5.7 s after
  TORCH_LOGS=recompiles check lora7b . --shape 7b $MB --set actor.lora.rank=64 --set actor.lora.alpha=128 \
    --weight-update-mode adapter --set actor.gradient_checkpointing=true
}
# Issue 48: the longest sequence each shape trains at c = 1, and its MFU.
long() {
  PYTHONPATH=/tmp/site:$PWD python3 tools/bench_long.py --shapes ${LONG_SHAPES:-1.5b,3b,7b} \
    --lengths ${LONG_LENGTHS:-16384,32768,65536,131072} --out $OUT/long.jsonl
}
run_parts "passed|failed|today|same weights|baseline:|launch|rollout at|ms a step|answers sent| gc |^step |e2e|longest|mfu|where the time|^ +[0-9]+ +[0-9]|check|exit code|Error|error|rows|profile|^ +[a-z_:<]|%|TB/s" "$@"
exit $status
