"""Benchmark the decoupled PPO loss's proximal policy: `ppo.prox_logp_method` recompute against loglinear.

`recompute` runs the `actor_inf` call, a forward pass over the batch before the update, for the proximal
logprobs; `loglinear` (AReaL's A-3PO approximation, docs/algorithms.md "Stale samples") drops that call and
interpolates them from the behaviour logprobs, the current policy's and each token's weight version. The two
only differ on stale tokens, so both run asynchronous RL (`async_rl=true`, `max_head_offpolicyness` = eta).

The workload, each run with `areal-hpc run` (local processes) in this process: the toy code task
(configs/toy-cpu.yaml + configs/toy-code.yaml) from one supervised warm-up, built as in
tests/test_algorithm_learning.py, then for each seed GRPO with recompute (the baseline) and with loglinear.
Per variant, means over the seeds with their spread: trainer seconds per step (`timeperf/actor_inf` +
`timeperf/actor_train`, steps 2 on: the first pays one-off start-up costs; the saving is the removed forward
pass), loop seconds per step (`timeperf/e2e`), the sampled task reward of the last 3 steps minus the first 3
and of the last 3 (monitor/summary.py's `learning_summary`), `ppo_actor/behave_imp_weight/avg` and the head
off-policyness of the trained answers; then the ratio loglinear / recompute of the trainer's time per step.

    python tools/bench_prox_logp.py [--steps 12] [--seeds 2] [--eta 2] [--set KEY=VALUE ...]

Exits non-zero when the loglinear variant fails to run, when a run trained on no stale answer (there is
then nothing to compare), or when loglinear's reward gain is not within noise of recompute's: the difference
of the seed means under twice its standard error.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.control.rundir import run_dir_of  # noqa: E402
from areal_hpc.launch.local import run_local  # noqa: E402
from areal_hpc.monitor.stats import read_stats  # noqa: E402
from areal_hpc.monitor.summary import learning_summary  # noqa: E402

TINY = REPO / ".cache" / "tiny"
CONFIGS = ["configs/toy-cpu.yaml", "configs/toy-code.yaml"]
WARM_UP = ["actor.optimizer.lr=1e-2", "exp_ctrl.total_train_epochs=6"]  # as tests/test_algorithm_learning.py
STEPS_PER_EPOCH = 32  # the toy code tasks: 256 prompts, 8 a step
WINDOW = 3  # steps averaged at each end of the reward curve
VARIANTS = [("recompute", "recompute (baseline)"), ("loglinear", "loglinear")]


class RunFailed(Exception):
    pass


def run(files: list[str], overrides: list[str]) -> Path:
    cfg = load_config([REPO / f for f in files], overrides)
    with open(os.devnull, "w") as quiet:
        code = run_local(cfg, out=quiet)
    if code != 0:
        raise RunFailed(f"{cfg.trial_name} failed ({code}); logs in {run_dir_of(cfg).logs}\n{log_tail(cfg)}")
    return run_dir_of(cfg).root


def log_tail(cfg, lines: int = 30) -> str:
    """The end of the first role's log that holds a traceback (where a failed run says why)."""
    for log in sorted(run_dir_of(cfg).logs.glob("attempt*/*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            tail = text[text.rindex("Traceback") :].splitlines()[:lines]
            return f"--- {log}:\n" + "\n".join(tail)
    return ""


def common(root: Path) -> list[str]:
    return [
        f"cluster.fileroot={root}",
        f"dataset.path={TINY / 'data' / 'code' / 'train.jsonl'}",
        "dataset.valid_path=null",
        "logging.tensorboard=false",
        "recover_mode=disabled",
    ]


def warm_up_overrides(root: Path) -> list[str]:
    return [*common(root), "trial_name=warm-up", f"actor.path={TINY / 'model'}", *WARM_UP]


def warm_up(root: Path) -> Path:
    """The supervised warm-up of tests/test_algorithm_learning.py; returns its checkpoint."""
    sft = run([*CONFIGS, "configs/toy-sft.yaml"], warm_up_overrides(root))
    (checkpoint,) = (sft / "checkpoints" / "actor").iterdir()
    return checkpoint


def command(files: list[str], overrides: list[str], checkpoint: Path | None = None) -> str:
    """The config files and overrides as `areal-hpc run` takes them, less the temporary run root."""
    shown = [o.replace(f"{REPO}/", "") for o in overrides if not o.startswith("cluster.fileroot")]
    if checkpoint is not None:
        shown = [o.replace(str(checkpoint), "<warm-up checkpoint>") for o in shown]
    return " ".join([*files, *shown])


def grpo_overrides(root: Path, checkpoint: Path, steps: int, eta: int) -> list[str]:
    epochs = -(-steps // STEPS_PER_EPOCH)  # the LR decays linearly to 0 over the benchmarked steps
    return [
        *common(root), f"actor.path={checkpoint}", "async_rl=true", f"max_head_offpolicyness={eta}",
        f"exp_ctrl.benchmark_steps={steps}", f"exp_ctrl.total_train_epochs={epochs}",
    ]  # fmt: skip


@dataclass
class Seed:
    """One run's numbers (per step: means over steps 2 on)."""

    trainer: float
    loop: float
    inf: float
    gain: float
    final: float
    imp_weight: float
    head_mean: float
    head_max: float


def measure(run_root: Path, steps: int) -> Seed:
    rows = read_stats(run_root / "logs" / "stats.jsonl")
    summary = learning_summary(rows, window=WINDOW)
    if summary["steps"] != steps:
        raise RunFailed(f"{run_root}: {summary['steps']} steps in stats.jsonl, not {steps}")
    timed = [r for r in rows if "timeperf/e2e" in r][1:] or [r for r in rows if "timeperf/e2e" in r]
    ppo = [r for r in rows if "ppo_actor/head_offpolicyness/avg" in r]

    def per_step(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in timed)

    return Seed(
        trainer=per_step("timeperf/actor_inf") + per_step("timeperf/actor_train"),
        loop=per_step("timeperf/e2e"),
        inf=per_step("timeperf/actor_inf"),
        gain=summary["reward_last"] - summary["reward_first"],
        final=summary["reward_last"],
        imp_weight=statistics.mean(r.get("ppo_actor/behave_imp_weight/avg", math.nan) for r in ppo),
        head_mean=statistics.mean(r["ppo_actor/head_offpolicyness/avg"] for r in ppo),
        head_max=max(r["ppo_actor/head_offpolicyness/max"] for r in ppo),
    )


@dataclass
class Result:
    label: str
    seeds: list[Seed] = field(default_factory=list)
    error: str | None = None

    def values(self, name: str) -> list[float]:
        return [getattr(s, name) for s in self.seeds]

    def mean(self, name: str) -> float:
        return statistics.mean(self.values(name))


def mean_sd(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if not math.isnan(v)]  # a statistic some run lacks
    if not values:
        return "-"
    sd = f" +- {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.{digits}f}{sd}"


def within_noise(a: list[float], b: list[float]) -> tuple[bool, float, float]:
    """Whether the seed means differ by less than twice the standard error of their difference (and both)."""
    se = ((statistics.variance(a) + statistics.variance(b)) / len(a)) ** 0.5
    diff = statistics.mean(b) - statistics.mean(a)
    return abs(diff) <= 2 * se, diff, se


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps of each run")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per variant (the noise of the reward)")
    parser.add_argument("--eta", type=int, default=2, help="max_head_offpolicyness: how stale data may be")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every GRPO run"
    )
    ns = parser.parse_args()
    if ns.seeds < 2:
        parser.error("--seeds must be 2 or more: the reward's noise is their spread")
    if ns.eta < 1:
        parser.error("--eta must be 1 or more: the two methods only differ on stale tokens")
    if ns.steps < 2 * WINDOW:
        parser.error(
            f"--steps must be {2 * WINDOW} or more: the reward gain compares first and last {WINDOW}"
        )
    if not (TINY / "MANIFEST.json").is_file():
        raise SystemExit(f"bench_prox_logp: {TINY} is missing: run `make tiny`")
    logging.getLogger("areal_hpc.config.inert").setLevel(logging.ERROR)  # the toy configs' idle options
    start = time.monotonic()
    results = [Result(label) for _, label in VARIANTS]
    with tempfile.TemporaryDirectory(prefix="bench-prox-logp-") as tmp:
        root = Path(tmp)
        checkpoint = warm_up(root)
        base = [*grpo_overrides(root, checkpoint, ns.steps, ns.eta), *ns.set]
        warm = command([*CONFIGS, "configs/toy-sft.yaml"], warm_up_overrides(root))
        print(f"warm-up ({time.monotonic() - start:.0f} s): {warm}")
        print(f"GRPO: {command(CONFIGS, base, checkpoint)} seed=S ppo.prox_logp_method=M")
        for seed in range(1, ns.seeds + 1):
            for (method, label), result in zip(VARIANTS, results, strict=True):
                if result.error:
                    continue
                t0 = time.monotonic()
                try:
                    run_root = run(
                        CONFIGS,
                        [
                            *base,
                            f"trial_name={method}-s{seed}",
                            f"seed={seed}",
                            f"ppo.prox_logp_method={method}",
                        ],
                    )
                    s = measure(run_root, ns.steps)
                except Exception as e:  # a config refused, a run failed: the variant failed
                    if method == "recompute":
                        raise
                    result.error = str(e) if isinstance(e, RunFailed) else traceback.format_exc()
                    print(f"  {label:22} seed {seed}: FAILED\n{result.error}")
                    continue
                result.seeds.append(s)
                print(f"  {label:22} seed {seed}: {time.monotonic() - t0:5.1f} s  "
                      f"trainer {s.trainer:.3f} s/step "
                      f"(actor_inf {s.inf:.3f})  loop {s.loop:.3f} s/step  reward gain {s.gain:+.3f}  "
                      f"final {s.final:.3f}  behave_imp_weight {s.imp_weight:.4f}  "
                      f"head off-policyness mean {s.head_mean:.2f} max {s.head_max:.0f}")  # fmt: skip
    print(f"\n{ns.seeds} seeds x {ns.steps} steps, eta = {ns.eta}, {time.monotonic() - start:.0f} s in all; "
          f"times per step over steps 2-{ns.steps}, mean +- sd over seeds")  # fmt: skip
    header = (f"{'variant':22} {'trainer s/step':>16} {'ratio':>6} {'loop s/step':>16} "
              f"{f'reward gain (last {WINDOW} - first {WINDOW})':>30} {f'reward (last {WINDOW})':>16} "
              f"{'behave_imp_weight':>18} {'head off-pol.':>13}")  # fmt: skip
    print(header)
    baseline = results[0]
    for r in results:
        if r.error:
            print(f"{r.label:22} FAILED")
            continue
        ratio = r.mean("trainer") / baseline.mean("trainer")
        print(f"{r.label:22} {mean_sd(r.values('trainer')):>16} {ratio:5.2f}x "
              f"{mean_sd(r.values('loop')):>16} "
              f"{mean_sd(r.values('gain')):>30} {mean_sd(r.values('final')):>16} "
              f"{mean_sd(r.values('imp_weight'), 4):>18} {r.mean('head_mean'):13.2f}")  # fmt: skip
    ok = True
    loglinear = results[1]
    if loglinear.error:
        print("loglinear: FAILED to run (above)")
        return 1
    stale = all(s.head_max >= 1 for r in results for s in r.seeds)
    if not stale:
        ok = False
        print("NO stale answers were trained on in some run: the two methods did the same thing")
    noise, diff, se = within_noise(baseline.values("gain"), loglinear.values("gain"))
    ok &= noise
    print(f"reward gain, loglinear - recompute: {diff:+.3f} "
          f"(2 x standard error {2 * se:.3f}, {ns.seeds} seeds): "
          f"{'within' if noise else 'NOT within'} noise")  # fmt: skip
    saved = baseline.mean("trainer") - loglinear.mean("trainer")
    ratio = loglinear.mean("trainer") / baseline.mean("trainer")
    print(f"trainer time per step, loglinear / recompute: {ratio:.2f}x ({saved:+.3f} s saved a step; "
          f"recompute's actor_inf {baseline.mean('inf'):.3f} s/step)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
