#!/bin/bash
# Issue 45's runs on one lent GPU (device tool; carry .cache/engine-baseline-45, a copy of the engine before the
# KV pool: `git archive 690455b areal_hpc/gen/backends/builtin | tar -x -C .cache/engine-baseline-45`). Each part
# logs to $OUT/<part>.log and writes $OUT/<part>.json; the script exits non-zero when a part failed.
#   tools/gpu_issue45.sh kernel engine short    # the paged kernel, the engine's CUDA checks, short answers
#   tools/gpu_issue45.sh long episodes          # long-tailed 7B answers, 64 8-turn episodes at 1.5B
#   tools/gpu_issue45.sh colocated              # GRPO steps of 1,024 and 8,192 long-tailed tokens (carry .whl too)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BASE=.cache/engine-baseline-45/areal_hpc/gen/backends/builtin
OUT=${OUT:-/tmp/out}
status=0
kernel() { python3 tools/gpu_check_paged.py; }
engine() { python3 tools/gpu_check_engine.py --shape 0.5b --rows 32 --tokens 128; }
short() {
  python3 tools/bench_gen.py --device cuda --shapes ${SHAPES:-1.5b,7b} --rows 1,64,256 --baseline $BASE \
    --baseline-tokens 1024 --out $OUT/short.json
}
long() {
  # The baseline gets BASE_SECS (default 280 s: the part fits a 10-minute call); cut off, it reports a bound.
  python3 tools/bench_gen_long.py --device cuda --mode long --shape 7b --baseline $BASE \
    --baseline-secs ${BASE_SECS:-280} --out $OUT/long.json
}
episodes() {
  python3 tools/bench_gen_long.py --device cuda --mode episodes --shape 1.5b --max-batch 64 --baseline $BASE \
    --out $OUT/episodes.json
}
colocated() {  # needs the carried wheels (.whl) and .cache/tiny: the run's roles import the whole stack
  source tools/gpu_env.sh
  for tokens in 1024 8192; do
    python3 tools/gpu_check_colocated.py --steps 3 --shape 1.5b --group-size 8 --max-new-tokens $tokens \
      --mem-fraction 0.5 --eos-ids 50
  done
}
nvidia-smi -L
for part in "$@"; do
  echo "=== $part"
  start=$(date +%s)
  $part 2>&1 | tee $OUT/$part.log | grep -v "^ *$" | tail -25 || { echo "FAILED: $part"; status=1; }
  echo "=== $part: $(( $(date +%s) - start )) s"
done
exit $status
