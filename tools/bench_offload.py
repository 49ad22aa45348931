"""Benchmark ``optimizer.offload``'s step (areal_hpc/train/backends/fsdp/offload.py): AdamW over a Qwen2.5
shape's float32 weights on the GPU, its moments in page-locked host memory, today's step against a baseline copy
of offload.py, taking turns in one process on one optimizer. Prints seconds a step, the GB/s of moments moved
each way and the ratio. First both step a 0.5B shape from the same start twice: weights and moments must be
equal bit for bit (a copy that raced its update would differ).

    git show b620a9c:areal_hpc/train/backends/fsdp/offload.py > .cache/baseline-46/offload_b620a9c.py
    python tools/bench_offload.py [--shape 7b] [--steps 3] --baseline .cache/baseline-46/offload_b620a9c.py

On a machine without a GPU it runs the CPU's path on the small shape (`make bench`): a dry run, no timing worth
reading.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train's shapes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `areal_hpc` importable

from bench_sampling import load  # noqa: E402
from bench_train import SHAPES, model_config  # noqa: E402

from areal_hpc.config import OptimizerConfig  # noqa: E402
from areal_hpc.train.backends.fsdp import offload  # noqa: E402
from areal_hpc.train.numerics import make_optimizer  # noqa: E402


def weights(shape: str, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    """The float32 weights of ``shape`` (random) with random gradients, as the trainer holds them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = [p.shape for p in AutoModelForCausalLM.from_config(model_config(shape)).parameters()]
    gen = torch.Generator(device).manual_seed(seed)
    params = []
    for size in shapes:
        p = torch.nn.Parameter(torch.randn(size, generator=gen, device=device) * 0.02)
        p.grad = torch.randn(size, generator=gen, device=device) * 1e-3
        params.append(p)
    return params


def optimizer_of(params: list[torch.nn.Parameter], pinned: bool) -> torch.optim.AdamW:
    optimizer = make_optimizer(torch.nn.ParameterList(params), OptimizerConfig(lr=1e-5))  # the trainer's
    offload.make_home(optimizer, pinned)
    return optimizer


def step(module, optimizer, params, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    module.offloaded_step(optimizer, params, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def same_result(baseline, shape: str, device: torch.device) -> bool:
    """Both steps, twice from the same start: equal weights and moments, bit for bit."""
    results = []
    for module in (baseline, offload):
        params = weights(shape, device)
        optimizer = optimizer_of(params, device.type == "cuda")
        for _ in range(2):
            step(module, optimizer, params, device)
        moments = [optimizer.state[p][k] for p in params for k in offload.MOMENTS]
        results.append([t.cpu() for t in params + moments])
        del params, optimizer, moments
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, choices=list(SHAPES), help="GPU default 7b; CPU: cpu")
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps of each, taking turns, after one warm-up"
    )
    p.add_argument("--baseline", default=None, help="a copy of offload.py to compare against (else: today's)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("7b" if device.type == "cuda" else "cpu")
    baseline = load(args.baseline, "offload_baseline") if args.baseline else offload
    if not args.baseline:
        print("no --baseline: today's step against itself")

    equal = same_result(baseline, "0.5b" if device.type == "cuda" else "cpu", device)
    print(f"same weights and moments as the baseline after two steps: {equal}", flush=True)
    params = weights(shape, device)
    optimizer = optimizer_of(params, device.type == "cuda")
    moved = 2 * sum(p.numel() for p in params) * 4  # the two float32 moments, each way
    times: dict[str, list[float]] = {"baseline": [], "today": []}
    for i in range(args.steps + 1):
        for name, module in (("baseline", baseline), ("today", offload)):
            seconds = step(module, optimizer, params, device)
            if i:  # the first of each warms the allocator and the kernels
                times[name].append(seconds)
    best = {name: min(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(
            f"{shape} {name}: {' '.join(f'{t:.3f}' for t in ts)} s a step; best {best[name]:.3f} s, "
            f"{moved / best[name] / 1e9:.1f} GB/s of moments each way",
            flush=True,
        )
    ratio = best["baseline"] / best["today"]
    print(f"{shape}: today {ratio:.2f}x the baseline ({moved / 1e9:.1f} GB of moments each way a step)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"shape": shape, "equal": equal, "times": times, "ratio": ratio})
        )
    if not equal:
        sys.exit("the offloaded step's result differs from the baseline's")


if __name__ == "__main__":
    main()
