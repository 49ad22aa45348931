"""`make demo`: supervised warm-up, then GRPO on toy arithmetic, every role a local process; a summary at the end.

    python tools/demo.py [--fileroot runs] [extra overrides for the GRPO run ...]

Exits non-zero when the policy did not learn: task reward of the last 5 steps must beat the first 5 by
at least 0.2, and held-out greedy accuracy must rise. Ends with the path of the learning curve (a PNG).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.control.rundir import RunDir, run_dir_of  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.monitor import plot_run  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402
from areal_hpc.monitor.summary import format_table, learning_summary  # noqa: E402

# Runs are not reproducible past the first steps (batched float32 numerics in the server change a sample now
# and then, and 168 steps amplify it): three runs gained +0.274, +0.304 and +0.328 (2026-12-01/02), and greedy
# accuracy went 0.20 -> 0.34-0.36. The bar sits below that spread; a policy that does not learn gains ~0.
MIN_REWARD_GAIN = 0.2


def last_checkpoint(run_root: Path) -> Path:
    """The actor checkpoint of the highest global step."""
    found = sorted(
        (run_root / "checkpoints" / "actor").iterdir(), key=lambda p: int(p.name.split("globalstep")[1])
    )
    if not found:
        raise SystemExit(f"demo: the warm-up wrote no checkpoint under {run_root}")
    return found[-1]


def run(config_files: list[str], overrides: list[str]) -> Path:
    cfg = load_config([REPO / f for f in config_files], overrides)
    code = run_local(cfg)
    if code != 0:
        raise SystemExit(f"demo: {cfg.experiment_name} failed (exit code {code})")
    return run_dir_of(cfg).root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fileroot", default=str(REPO / "runs"))
    parser.add_argument("overrides", nargs="*", help="overrides of the GRPO run")
    ns = parser.parse_args()
    trial = "demo-" + time.strftime("%Y%m%d-%H%M%S")
    common = [f"cluster.fileroot={ns.fileroot}", f"trial_name={trial}"]
    start = time.monotonic()
    print("== 1/2 supervised warm-up (areal-hpc run configs/toy-cpu.yaml configs/toy-sft.yaml)")
    sft_root = run(["configs/toy-cpu.yaml", "configs/toy-sft.yaml"], common)
    print("== 2/2 GRPO (areal-hpc run configs/toy-cpu.yaml actor.path=<warm-up checkpoint>)")
    rl_root = run(
        ["configs/toy-cpu.yaml"], [*common, f"actor.path={last_checkpoint(sft_root)}", *ns.overrides]
    )
    rl = RunDir(rl_root)
    rows = read_stats(rl.stats)
    s = learning_summary(rows)
    gain = s["reward_last"] - s["reward_first"]
    learned = gain >= MIN_REWARD_GAIN and s["greedy_after"] > s["greedy_before"]
    print()
    print(format_table([
        ("GRPO on toy arithmetic", "result"),
        ("steps", f"{s['steps']}"),
        ("task reward, first 5 steps", f"{s['reward_first']:.3f}"),
        ("task reward, last 5 steps", f"{s['reward_last']:.3f} ({gain:+.3f}; needed >= +{MIN_REWARD_GAIN})"),
        ("held-out greedy accuracy before RL", f"{s['greedy_before']:.3f}"),
        ("held-out greedy accuracy after RL", f"{s['greedy_after']:.3f}"),
        ("wall time, both runs", f"{time.monotonic() - start:.0f} s"),
        ("warm-up run", str(sft_root)),
        ("GRPO run", str(rl_root)),
        ("verdict", "LEARNED" if learned else "DID NOT LEARN"),
    ]))  # fmt: skip
    plot_run(rows, rl.plots)
    print(f"learning curve: {rl.plots / 'reward.png'} (every figure: areal-hpc plot {rl_root})")
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
