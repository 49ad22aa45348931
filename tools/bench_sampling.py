"""Benchmark a decode step's sampling: ``SlotSampling.sample`` over [rows, vocab] bf16 logits (temperature 1, a
stop token banned for half the rows), today's against a baseline copy of ``sampling.py``, and today's Triton
launch (blocks per program, warps) swept. Prints ms per call of each and the ratio; the GPU's.

    mkdir -p .cache/baseline-46 && git archive 9dd158c areal_hpc | tar -x -C .cache/baseline-46
    python tools/bench_sampling.py [--rows 128] [--vocab 151936] \\
        [--baseline .cache/baseline-46/areal_hpc/gen/backends/builtin/sampling.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `areal_hpc` importable

from areal_hpc.gen.backends.builtin import sampling  # noqa: E402
from areal_hpc.gen.backends.builtin.protocol import SamplingParams  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ms_per_call(module, logits: torch.Tensor, calls: int) -> float:
    rows, vocab = logits.shape
    slots = module.SlotSampling(rows, vocab, logits.device)
    params = [SamplingParams(temperature=1.0, min_new_tokens=8 * (i % 2)) for i in range(rows)]
    slots.set(list(range(rows)), params, list(range(rows)), [frozenset({vocab - 5})] * rows)
    for _ in range(3):
        slots.sample(logits, slice(0, rows))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        slots.sample(logits, slice(0, rows))
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--baseline", default=None, help="an older copy of sampling.py")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).bfloat16()
    result = {"rows": args.rows, "vocab": args.vocab, "device": torch.cuda.get_device_name()}
    sweep = {}
    for per in (4, 8, 16, 32):
        for warps in (4, 8):
            sampling.LAUNCH.update(per=per, warps=warps)
            sweep[f"{per}/{warps}"] = ms_per_call(sampling, logits, args.calls)
    best = min(sweep, key=sweep.get)
    sampling.LAUNCH.update(per=8, warps=4)
    result |= {"today_ms": ms_per_call(sampling, logits, args.calls), "sweep_ms": sweep, "best": best}
    print(f"today: {result['today_ms']:.3f} ms a call at {args.rows} x {args.vocab}")
    print("launch (blocks/warps): " + "  ".join(f"{k} {v:.3f}" for k, v in sweep.items()) + f"; best {best}")
    if args.baseline:
        result["baseline_ms"] = ms_per_call(load(args.baseline), logits, args.calls)
        result["speedup"] = result["baseline_ms"] / result["today_ms"]
        print(f"baseline: {result['baseline_ms']:.3f} ms a call; today {result['speedup']:.2f}x faster")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
