# Source this first on a lent GPU machine (device tool, carry .whl and, for the toy, .cache/tiny): installs the
# carried wheels (submitit, megatron-core, math-verify, peft and accelerate, orjson, and their needs) beside the
# image's torch and transformers, and sets the environment every GPU script here expects.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L

# run_parts PATTERN PART...: each part (a function of the calling script) logged whole to $OUT/<part>.log, its
# lines matching PATTERN shown; a part that fails or shows none of them fails the script (the caller's $status).
run_parts() {
  local pattern=$1 part start; shift
  for part in "$@"; do
    echo "=== $part"
    start=$(date +%s)
    $part 2>&1 | tee $OUT/$part.log | grep -E "$pattern" || { echo "FAILED: $part"; status=1; }
    echo "=== $part: $(( $(date +%s) - start )) s"
    # BACK: the device tool's $OUT, which returns at most 8 files, and those a killed call left: after each part
    # everything so far, packed (tools/gpu_call.sh sets both).
    [ -z "$BACK" ] || tar czf "$BACK/r.tgz" -C "$OUT" .
  done
}
