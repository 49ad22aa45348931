# Source this first on a lent GPU machine (device tool, carry .whl and, for the toy, .cache/tiny): installs the
# carried wheels (submitit, megatron-core, math-verify, peft and accelerate, and their needs) beside the image's torch and
# transformers, and sets the environment every GPU script here expects.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L
