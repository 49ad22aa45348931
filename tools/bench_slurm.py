"""Benchmark the Slurm launch: submit -> first completed training step, against `areal-hpc run` in the same run.

Runs the toy config (tiny model, small batches) twice: as local processes (the baseline) and submitted as one
heterogeneous job to the local Slurm cluster (tools/slurm_local; started here when none runs, as root). For
each it prints the time from launch to the first completed step, and the controller's overhead per step:
the step's wall time minus the time inside MFC calls and the weight sync (timeperf/* in stats.jsonl).

    python tools/bench_slurm.py [--steps 8]

Exits non-zero when submit -> first step exceeds the 60 s target; prints SKIP and exits 0 where no Slurm
cluster can run (not root).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.control.rundir import RunDir, run_dir_of  # noqa: E402
from areal_hpc.launch import slurm, submit  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402
from tools.slurm_local import cluster as slurm_local  # noqa: E402

TARGET_FIRST_STEP_SECS = 60.0


def toy(fileroot: Path, trial: str, steps: int):
    tiny = REPO / ".cache" / "tiny"
    overrides = [
        f"cluster.fileroot={fileroot}", f"trial_name={trial}", f"actor.path={tiny / 'model'}",
        f"dataset.path={tiny / 'data/easy/train.jsonl'}", f"dataset.valid_path={tiny / 'data/easy/test.jsonl'}",
        "dataset.train_bs_n_seqs=16", "group_size=4", f"exp_ctrl.benchmark_steps={steps}",
    ]  # fmt: skip
    return load_config([REPO / "configs/toy-cpu.yaml"], overrides)


def first_step_time(run: RunDir, since: float, timeout: float = 300.0) -> float:
    """Seconds from `since` (time.time()) until stats.jsonl records a training step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [r for r in read_stats(run.stats) if "timeperf/e2e" in r] if run.stats.exists() else []
        if steps:
            return steps[0]["time"] - since
        time.sleep(0.2)
    raise TimeoutError(f"no training step in {run.stats} within {timeout:.0f} s")


def overhead_per_step(run: RunDir) -> tuple[float, float]:
    """Mean controller overhead per step (s) and mean step time (s), steps after the first."""
    steps = [r for r in read_stats(run.stats) if "timeperf/e2e" in r][1:]
    inside = [
        sum(v for k, v in r.items() if k.startswith("timeperf/") and k != "timeperf/e2e") for r in steps
    ]
    e2e = [r["timeperf/e2e"] for r in steps]
    return statistics.mean(e - i for e, i in zip(e2e, inside, strict=True)), statistics.mean(e2e)


def bench_local(fileroot: Path, steps: int) -> tuple[float, RunDir]:
    cfg = toy(fileroot, "local", steps)
    start = time.time()
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(first_step_time(run_dir_of(cfg), start)))
    thread.start()
    with open(os.devnull, "w") as quiet:
        code = run_local(cfg, out=quiet)
    thread.join()
    if code != 0:
        raise RuntimeError(f"areal-hpc run failed ({code}); logs in {run_dir_of(cfg).logs}")
    return result[0], run_dir_of(cfg)


def bench_slurm(fileroot: Path, steps: int) -> tuple[float, RunDir]:
    sub = submit.prepare(toy(fileroot, "slurm", steps))
    start = time.time()
    (job_id,) = submit.submit(sub)
    first = first_step_time(sub.run, start)
    states = slurm.wait_final([job_id], timeout=300)
    if set(states.values()) != {"COMPLETED"}:
        raise RuntimeError(f"job {job_id} ended {states}; logs in {sub.run.logs}")
    return first, sub.run


def ensure_cluster() -> tuple[bool, str]:
    if slurm_local.is_running():
        cluster = slurm_local.Cluster(slurm_local.default_root())
    else:
        ok, reason = slurm_local.can_run()
        if not ok:
            return False, reason
        cluster = slurm_local.start()
        print(f"started a local Slurm cluster at {cluster.root} (stop it with `make slurm-down`)")
    os.environ.update(cluster.env())
    return True, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    ns = parser.parse_args()
    ok, reason = ensure_cluster()
    if not ok:
        print(f"SKIP: no local Slurm cluster: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as root:
        local_first, local_run = bench_local(Path(root), ns.steps)
        slurm_first, slurm_run = bench_slurm(Path(root), ns.steps)
        local_over, local_step = overhead_per_step(local_run)
        slurm_over, slurm_step = overhead_per_step(slurm_run)
    print(f"{'':34} {'areal-hpc run':>14} {'submit (hetjob)':>16} {'ratio':>7}")
    print(f"{'launch -> first training step':34} {local_first:13.1f}s {slurm_first:15.1f}s "
          f"{slurm_first / local_first:6.2f}x")  # fmt: skip
    print(f"{'step time (mean, after the first)':34} {local_step:13.2f}s {slurm_step:15.2f}s "
          f"{slurm_step / local_step:6.2f}x")  # fmt: skip
    print(f"{'controller overhead per step':34} {local_over:13.3f}s {slurm_over:15.3f}s "
          f"{slurm_over / max(local_over, 1e-9):6.2f}x")  # fmt: skip
    passed = slurm_first <= TARGET_FIRST_STEP_SECS
    print(f"submit -> first step {slurm_first:.1f} s (target <= {TARGET_FIRST_STEP_SECS:.0f} s): "
          f"{'PASS' if passed else 'FAIL'}")  # fmt: skip
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
