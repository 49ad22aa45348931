#!/bin/bash
# Run tools/bench_async.py on a GPU machine (the device tool's H200): carry .whl (submitit, antlr4 wheels)
# and .cache/tiny; the image has torch, transformers, h5py, safetensors, jinja2, sympy, pyyaml.
set -o pipefail
source tools/gpu_env.sh
python3 tools/bench_async.py "$@" 2>&1 | tee "${OUT:-/tmp}/bench_async_gpu.log"
