"""Causal attention's forward and backward at long context on a GPU: the trainer's kernel (torch's varlen
FlashAttention) against its cuDNN path for long sequences (``train.packed._cudnn``: SDPA's cuDNN backend on the
sequence padded to a multiple of 256, on when ``CUDNN_FROM`` is set) and SDPA's backends on one sequence, in
TFLOP/s and as a ratio to FlashAttention's. Which kernel a long micro-batch should run (issue 48: the 7B shape
at 32k).

    python tools/bench_attention.py [--lengths 8192,32768,65536] [--heads 28 --kv-heads 4 --head-dim 128]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from areal_hpc.train.packed import _cudnn, _varlen


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure(fn, q, k, v, grad) -> tuple[float, float]:
    """Seconds of ``fn``'s forward, and of its forward and backward."""
    return timed(lambda: fn(q, k, v)), timed(lambda: torch.autograd.backward(fn(q, k, v), grad))


def kernels(t: int, heads: int, kv_heads: int, dim: int):
    """name -> attention of [t, heads, dim] q and [t, kv_heads, dim] k, v -> [t, heads, dim]."""
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")

    def sdpa(backend: SDPBackend, repeat: bool):
        def run(q, k, v):
            if repeat:  # a backend without grouped-query attention: as many key heads as query heads
                k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(
                    *(x.transpose(0, 1) for x in (q, k, v)), is_causal=True, enable_gqa=not repeat
                )
            return out.transpose(0, 1)

        return run

    yield "varlen flash", lambda q, k, v: _varlen(q, k, v, cu, t, None)
    yield "cudnn, padded (the trainer's path)", lambda q, k, v: _cudnn(q, k, v, None)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        yield f"sdpa {backend.name.lower()}", sdpa(backend, repeat=False)
        yield f"sdpa {backend.name.lower()}, k/v repeated", sdpa(backend, repeat=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768,65536")
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    args = parser.parse_args()
    rows = []
    for t in map(int, args.lengths.split(",")):
        q = torch.randn(t, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(
                t, args.kv_heads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
            )
            for _ in range(2)
        )
        grad = torch.randn_like(q)
        forward_flops = 2 * t * t * args.heads * args.head_dim  # causal: half of 4 t^2 h d
        base = None
        for name, fn in kernels(t, args.heads, args.kv_heads, args.head_dim):
            try:
                fwd, both = measure(fn, q, k, v, grad)
            except RuntimeError as error:  # a backend that refuses this shape
                print(f"{t:>7} {name:<34} refused: {str(error).splitlines()[0][:90]}")
                continue
            row = {
                "tokens": t,
                "kernel": name,
                "forward_s": fwd,
                "forward_backward_s": both,
                "tflops": 3.5 * forward_flops / both / 1e12,  # backward: 2.5 forwards
            }
            base = base or row
            row["speedup"] = base["forward_backward_s"] / both
            rows.append(row)
            print(
                f"{t:>7} {name:<34} forward {fwd * 1e3:8.2f} ms  forward+backward {both * 1e3:8.2f} ms  "
                f"{row['tflops']:6.1f} TFLOP/s  {row['speedup']:.2f}x FlashAttention's"
            )
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
