#!/bin/bash
# Run tools/bench_async.py on a GPU machine (the device tool's H200): carry .whl (submitit, antlr4 wheels)
# and .cache/tiny; the image has torch, transformers, h5py, safetensors, jinja2, sympy, pyyaml.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L
python3 tools/bench_async.py "$@" 2>&1 | tee "${OUT:-/tmp}/bench_async_gpu.log"
