"""Benchmark a decode step's sampling: ``SlotSampling.sample`` over [rows, vocab] bf16 logits (temperature 1, a
stop token banned for half the rows), today's against a baseline copy of ``sampling.py``, each replayed from a
CUDA graph (as a decode step samples: the device's time) and eager (the host's launches), and today's Triton
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


def load(path: str, name: str = "sampling_baseline"):
    """The module in the file ``path`` (a baseline's copy), imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ms_per_call(module, logits: torch.Tensor, calls: int, graph: bool) -> float:
    """Milliseconds a call: eager (the host launches each kernel) or replayed from a CUDA graph (the device's
    time: how a decode step samples)."""
    rows, vocab = logits.shape
    slots = module.SlotSampling(rows, vocab, logits.device)
    params = [SamplingParams(temperature=1.0, min_new_tokens=8 * (i % 2)) for i in range(rows)]
    slots.set(list(range(rows)), params, list(range(rows)), [frozenset({vocab - 5})] * rows)
    call = lambda: slots.sample(logits, slice(0, rows))  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        call = captured.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
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
            sweep[f"{per}/{warps}"] = ms_per_call(sampling, logits, args.calls, graph=True)
    best = min(sweep, key=sweep.get)
    print(
        "launch (blocks/warps), graph ms: "
        + "  ".join(f"{k} {v:.3f}" for k, v in sweep.items())
        + f"; best {best}"
    )
    sampling.LAUNCH.update(per=8, warps=4)
    modules = {"today": sampling} | ({"baseline": load(args.baseline)} if args.baseline else {})
    for name, module in modules.items():
        for graph in (True, False):
            key = f"{name}_{'graph' if graph else 'eager'}_ms"
            result[key] = ms_per_call(module, logits, args.calls, graph)
        print(
            f"{name}: {result[f'{name}_graph_ms']:.3f} ms a call in a graph, "
            f"{result[f'{name}_eager_ms']:.3f} eager"
        )
    if args.baseline:
        result["speedup_graph"] = result["baseline_graph_ms"] / result["today_graph_ms"]
        print(f"today in a graph: {result['speedup_graph']:.2f}x the baseline's speed")
    result |= {"sweep_graph_ms": sweep, "best": best}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
