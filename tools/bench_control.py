"""Benchmark the file-based control layer (areal_hpc/control) and check it against its targets.

1. Round trip: a caller process posts a request to a WorkerServer in another process and waits for the
   reply, a few thousand times; p50 and p99 of the latency.
2. Registration: 1024 simulated workers (threads spread over a few processes) each write their address file
   (as generation servers announce themselves) and start a heartbeat at once; wall time from the start until
   the controller sees all of them.

Usage::

    python tools/bench_control.py [--dir /path/on/shared/storage] [--round-trips 3000] [--workers 1024]

Prints a table with the targets and PASS/FAIL; exits 1 if any target is missed. Without ``--dir`` it runs in
a temporary folder under the repository's ``.cache/`` (local disk), removed afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `areal_hpc` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_hpc.control import Heartbeat, Mailbox, RunDir, WorkerServer, dead_workers, fsio  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
# The repo's git-ignored cache on local disk; /tmp on some hosts is far slower at creating files (~1 ms each).
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".cache"
TARGETS = {"p50_ms": 5.0, "p99_ms": 50.0, "register_s": 10.0}


def _echo(payload: object) -> object:
    return payload


def _serve_echo(run_dir: str) -> None:
    WorkerServer(RunDir(Path(run_dir)), "echo", {"echo": _echo}).serve()


def bench_round_trip(run_dir: Path, n: int, warmup: int = 100) -> list[float]:
    """Latencies in seconds of ``n`` request -> reply round trips with a worker in another process."""
    worker = SPAWN.Process(target=_serve_echo, args=(str(run_dir),))
    worker.start()
    box = Mailbox(RunDir(run_dir).mailboxes)
    try:
        for i in range(warmup):  # also waits for the worker to start
            box.request("echo", "echo", {"i": i}, timeout=60)
        latencies = []
        for i in range(n):
            start = time.perf_counter()
            box.request("echo", "echo", {"i": i}, timeout=60)
            latencies.append(time.perf_counter() - start)
        box.request("echo", "stop", timeout=60)
    finally:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.kill()
    return latencies


def _register_workers(run_dir: str, ranks: list[int], stop_file: str) -> None:
    """One process of simulated workers: a thread per rank writes its address and starts a heartbeat."""
    beats: list[Heartbeat] = []
    lock = threading.Lock()

    def register(rank: int) -> None:
        run = RunDir(Path(run_dir))
        fsio.write_json(run.gen_address(rank), {"rank": rank, "url": f"http://node:{20000 + rank}"})
        beat = Heartbeat(run.heartbeats, f"worker{rank}", interval=1.0).start()
        with lock:
            beats.append(beat)

    threads = [threading.Thread(target=register, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while not Path(stop_file).exists():
        time.sleep(0.05)
    for beat in beats:
        beat.stop()


def _all_visible(run: RunDir, names: list[str]) -> bool:
    """All workers wrote their address and have a live heartbeat (the cheap count is tested first)."""
    n = len(names)
    if len(fsio.list_names(run.gen_servers)) < n or len(fsio.list_names(run.heartbeats)) < n:
        return False
    addresses = [fsio.read_json(run.gen_address(rank)) for rank in range(n)]
    return all(addresses) and not dead_workers(run.heartbeats, names, timeout=30)


def bench_registration(run_dir: Path, n_workers: int, n_procs: int) -> float:
    """Seconds from launching ``n_workers`` simulated workers until all announced themselves and beat."""
    stop_file = run_dir / "stop-registration"
    ranks = [list(range(p, n_workers, n_procs)) for p in range(n_procs)]
    names = [f"worker{r}" for r in range(n_workers)]
    start = time.perf_counter()
    procs = [SPAWN.Process(target=_register_workers, args=(str(run_dir), r, str(stop_file))) for r in ranks]
    for p in procs:
        p.start()
    try:
        while not _all_visible(RunDir(run_dir), names):
            if time.perf_counter() - start > 120:
                raise TimeoutError(f"{n_workers} workers did not all register within 120 s")
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
    finally:
        stop_file.touch()
        for p in procs:
            p.join(timeout=60)
    return elapsed


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks, print the table; 0 when every target is met, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="where the run directories go (a temporary folder inside)",
    )
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated workers run in")
    args = parser.parse_args(argv)

    args.dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]  # before we add our own threads: latency suffers when the CPUs are busy
    with tempfile.TemporaryDirectory(prefix="bench_control_", dir=args.dir) as tmp:
        latencies = bench_round_trip(Path(tmp) / "rt", args.round_trips)
        register_s = bench_registration(Path(tmp) / "reg", args.workers, args.processes)
        where = Path(tmp).parent

    p50, p99 = _percentile(latencies, 50) * 1e3, _percentile(latencies, 99) * 1e3
    rows = [
        (f"round trip p50 ({len(latencies)} trips)", p50, "ms", TARGETS["p50_ms"]),
        (f"round trip p99 ({len(latencies)} trips)", p99, "ms", TARGETS["p99_ms"]),
        (f"{args.workers} workers registered", register_s, "s", TARGETS["register_s"]),
    ]
    print(
        f"control-layer benchmark in {where} on {os.cpu_count()} CPUs, 1-min load {load:.1f} before start, "
        f"max round trip {max(latencies) * 1e3:.1f} ms"
    )
    print(f"{'metric':<34} {'value':>10} {'target':>10}  result")
    failed = False
    for label, value, unit, target in rows:
        ok = value <= target
        failed |= not ok
        print(
            f"{label:<34} {f'{value:.2f} {unit}':>10} {f'<= {target:g} {unit}':>10}  {'PASS' if ok else 'FAIL'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
