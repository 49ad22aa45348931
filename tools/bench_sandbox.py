"""Benchmark the sandbox of model-written code: executions per second of a small test-case program, sandboxed
(areal_hpc.reward.Sandbox) against bare `python -c` of the same program, both measured in this run, one at a
time and `--workers` at once.

    python tools/bench_sandbox.py [--runs 200] [--workers 2]

Prints the protections the sandbox has here, each variant's executions per second and the sandbox's share of
the bare rate. Exits 1 when a sandboxed run gives a wrong answer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_hpc.reward import Limits, Sandbox  # noqa: E402

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def bare(python: str, i: int) -> str:
    return subprocess.run(
        [python, "-I", "-S", "-c", PROGRAM], input=f"{i} 1\n", capture_output=True, text=True
    ).stdout


def rate(run, runs: int, workers: int) -> tuple[float, list[str]]:
    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(run, range(runs)))
    return runs / (time.monotonic() - start), outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    ns = parser.parse_args()
    sandbox = Sandbox(Limits(time_secs=2.0))
    print(sandbox.protections.describe())
    boxed = lambda i: sandbox.run(PROGRAM, stdin=f"{i} 1\n").stdout  # noqa: E731
    plain = lambda i: bare(sandbox.python, i)  # noqa: E731
    ok = True
    print(f"{'variant':<28} {'exec/s':>8} {'vs bare':>8}")
    for workers in (1, ns.workers):
        base, _ = rate(plain, ns.runs, workers)
        box, outs = rate(boxed, ns.runs, workers)
        ok &= outs == [f"{i + 1}\n" for i in range(ns.runs)]
        print(f"{f'bare python -c, {workers} at once':<28} {base:8.1f} {'1.00x':>8}")
        print(f"{f'sandboxed, {workers} at once':<28} {box:8.1f} {box / base:7.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
