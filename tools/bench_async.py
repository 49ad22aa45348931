"""Benchmark asynchronous RL: wall time of the same number of steps with eta = 0 (synchronous) and eta = 4.

Two workloads, each run with `areal-hpc run` (local processes) in this process:
- toy: GRPO on the toy arithmetic task from a short supervised warm-up (as `make demo`); reports the final
  task reward too, which must stay within noise of the synchronous run;
- long-tail: the untrained tiny model with a set of stop tokens, so answer lengths are geometric with a long
  tail (mean ~1024/len(stop_token_ids) tokens, the longest of a batch several times the mean): the regime of
  long reasoning traces where a synchronous step waits for its longest answer.
Each workload runs eta = 0 (the baseline, equal to synchronous PPO), then eta = 4 with interruptible generation
on and off. Prints wall time, time inside the training loop (the sum of step times; start-up is the same for
every variant) and the loop's speed-up against the baseline measured in the same run.

    python tools/bench_async.py [--steps 30] [--tail-steps 12] [--only toy|long-tail]

Exits non-zero when eta = 4 with interruption is less than 2x faster than eta = 0 on the long-tail workload
(loop time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.launch.rundir import run_dir_of  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402

TARGET_SPEEDUP = 2.0
TINY = REPO / ".cache" / "tiny"
VARIANTS = [  # (label, trial name, overrides)
    ("eta=0 (sync)", "eta0", ["max_head_offpolicyness=0"]),
    ("eta=4, interruptible", "eta4", ["max_head_offpolicyness=4", "interruptible_generation=true"]),
    ("eta=4, no interruption", "eta4-noint", ["max_head_offpolicyness=4", "interruptible_generation=false"]),
]


def run(files: list[str], overrides: list[str]) -> tuple[float, Path]:
    cfg = load_config([REPO / f for f in files], overrides)
    start = time.monotonic()
    with open(os.devnull, "w") as quiet:
        code = run_local(cfg, out=quiet)
    if code != 0:
        raise SystemExit(f"bench_async: {cfg.trial_name} failed ({code}); logs in {run_dir_of(cfg).logs}")
    return time.monotonic() - start, run_dir_of(cfg).root


def loop_secs(run_root: Path) -> float:
    """Seconds inside the training loop (the sum of step times): what asynchrony changes; start-up and the
    held-out evaluations are the same in every variant."""
    return sum(
        r["timeperf/e2e"] for r in read_stats(run_root / "logs" / "stats.jsonl") if "timeperf/e2e" in r
    )


def final_reward(run_root: Path, last: int = 5) -> float:
    rows = [r for r in read_stats(run_root / "logs" / "stats.jsonl") if "ppo_actor/task_reward/avg" in r]
    return statistics.mean(r["ppo_actor/task_reward/avg"] for r in rows[-last:])


def warm_up(root: Path) -> Path:
    """The demo's supervised warm-up; returns its last checkpoint."""
    _, sft = run(
        ["configs/toy-cpu.yaml", "configs/toy-sft.yaml"], [f"cluster.fileroot={root}", "trial_name=sft"]
    )
    return sorted(
        (sft / "checkpoints" / "actor").iterdir(), key=lambda p: int(p.name.split("globalstep")[1])
    )[-1]


def workload(name: str, root: Path, steps: int) -> list[str]:
    common = [f"cluster.fileroot={root}", "async_rl=true", f"exp_ctrl.benchmark_steps={steps}"]
    common += ["cluster.n_nodes=1", "cluster.n_gpus_per_node=2"]
    if name == "toy":
        return [*common, f"actor.path={warm_up(root)}"]
    stop = list(range(100, 116))  # 16 of 1024 tokens end an answer: geometric lengths, mean ~64
    return [
        *common, f"actor.path={TINY / 'model'}", f"ppo.gen.stop_token_ids={stop}", "ppo.gen.max_new_tokens=512",
        "dataset.valid_path=null",
        "dataset.train_bs_n_seqs=16", "group_size=4", "ppo.ppo_n_minibatches=1",
    ]  # fmt: skip


def bench(name: str, root: Path, steps: int) -> list[tuple[str, float, float, float]]:
    """(variant, wall seconds, loop seconds, final reward) of each variant."""
    base = workload(name, root, steps)
    rows = []
    for label, trial, extra in VARIANTS:
        secs, run_root = run(["configs/toy-cpu.yaml"], [*base, f"trial_name={name}-{trial}", *extra])
        rows.append((label, secs, loop_secs(run_root), final_reward(run_root)))
        print(f"  {name:9} {label:24} {secs:7.1f} s (loop {rows[-1][2]:.1f} s)  reward {rows[-1][3]:.3f}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps of the toy workload")
    parser.add_argument("--tail-steps", type=int, default=12, help="steps of the long-tail workload")
    parser.add_argument("--only", choices=("toy", "long-tail"))
    ns = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as root:
        for name, steps in (("toy", ns.steps), ("long-tail", ns.tail_steps)):
            if ns.only in (None, name):
                results[name] = bench(name, Path(root), steps)
    print(
        f"\n{'workload':10} {'variant':24} {'wall':>8} {'loop':>8} {'loop speed-up':>14} {'final reward':>13}"
    )
    for name, rows in results.items():
        base = rows[0][2]
        for label, wall, loop, reward in rows:
            print(f"{name:10} {label:24} {wall:7.1f}s {loop:7.1f}s {base / loop:13.2f}x {reward:13.3f}")
    if "long-tail" not in results:
        return 0
    speedup = results["long-tail"][0][2] / results["long-tail"][1][2]
    ok = speedup >= TARGET_SPEEDUP
    print(f"long-tail loop speed-up of eta=4 (interruptible) over eta=0: {speedup:.2f}x "
          f"(target >= {TARGET_SPEEDUP:.1f}x): {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
