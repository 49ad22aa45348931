"""The tiny model learns the toy code tasks with the named algorithms (configs/algorithms/*.yaml) layered over the
code recipe, from one supervised warm-up: the presets are not only valid, they train (tests/test_code_learning.py
is the same task under the recipe's own GRPO)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats
from areal_hpc.monitor.summary import learning_summary
from tests.helpers import REPO_ROOT

CONFIGS = [REPO_ROOT / "configs" / "toy-cpu.yaml", REPO_ROOT / "configs" / "toy-code.yaml"]
WARM_UP = ("actor.optimizer.lr=1e-2", "exp_ctrl.total_train_epochs=6")  # as tests/test_code_learning.py
# Mean sampled task reward of the last 3 of 10 steps minus the first 3, from one warm-up: dapo +0.344, gspo +0.406,
# rloo +0.365 (the recipe's own GRPO: +0.31 to +0.52, tests/test_code_learning.py; not learning: ~0, +-0.08).
MIN_REWARD_GAIN = 0.15
# Distillation from the untrained model: at the warm-up's lr the reverse KL falls by 1.4 nats a token (mean of the
# first 3 of 12 steps against the last 3: 10.46 -> 9.07), and from 10.6 to 7.4 over 20 steps (at 2e-3: 10.6 to
# 10.1 in 10); a student that does not learn stays at ~10.5, +-0.2 from step to step.
OPD = ("actor.optimizer.lr=1e-2", "exp_ctrl.benchmark_steps=12")
MIN_KL_FALL = 0.7


@pytest.fixture(scope="module")
def common(tmp_path_factory, tiny_build) -> list[str]:
    return [
        f"cluster.fileroot={tmp_path_factory.mktemp('runs')}",
        f"dataset.path={tiny_build.root / 'data' / 'code' / 'train.jsonl'}",
        "dataset.valid_path=null",
        "logging.tensorboard=false",
        "recover_mode=disabled",
    ]


@pytest.fixture(scope="module")
def warmed_up(common, tiny_build) -> Path:
    """The tiny model after the format warm-up (its checkpoint): it passes about one task in three."""
    cfg = load_config(
        [*CONFIGS, REPO_ROOT / "configs" / "toy-sft.yaml"],
        [*common, "trial_name=warm-up", f"actor.path={tiny_build.model_dir}", *WARM_UP],
    )
    assert run_local(cfg) == 0
    (checkpoint,) = (run_dir_of(cfg).root / "checkpoints" / "actor").iterdir()
    return checkpoint


def run(common, preset: str, *overrides: str) -> list[dict]:
    configs = [*CONFIGS, REPO_ROOT / "configs" / "algorithms" / f"{preset}.yaml"]
    cfg = load_config(configs, [*common, f"trial_name={preset}", *overrides])
    assert run_local(cfg) == 0
    return read_stats(run_dir_of(cfg).stats)


def learn(common, warmed_up, preset: str) -> list[dict]:
    rows = run(common, preset, f"actor.path={warmed_up}")
    summary = learning_summary(rows, window=3)
    assert summary["steps"] == 10
    assert summary["reward_last"] - summary["reward_first"] >= MIN_REWARD_GAIN, summary
    return rows


@pytest.mark.slow
def test_dapo_learns_and_drops_the_groups_of_equal_rewards(common, warmed_up):
    rows = learn(common, warmed_up, "dapo")
    assert sum(r.get("rollout/dynamic_sampling_dropped", 0) for r in rows) > 0
    assert all(r["ppo_actor/n_seqs"] == 8 * 4 for r in rows if "ppo_actor/n_seqs" in r)
    assert any(r["ppo_actor/clip_ratio_high/avg"] > 0 for r in rows)


@pytest.mark.slow
def test_gspo_learns(common, warmed_up):
    rows = learn(common, warmed_up, "gspo")
    assert any(r["ppo_actor/clip_ratio/avg"] > 0 for r in rows)  # its clip range is tiny: it does clip


@pytest.mark.slow
def test_rloo_learns(common, warmed_up):
    learn(common, warmed_up, "rloo")


def test_on_policy_distillation_pulls_the_untrained_student_towards_its_teacher(
    common, warmed_up, tiny_build
):
    # The teacher is the warmed-up model, the student the untrained one: the sampled tokens' reverse KL to the
    # teacher falls, with no task reward at all (opd: the distillation advantage alone).
    rows = run(common, "opd", f"actor.path={tiny_build.model_dir}", f"teacher.path={warmed_up}", *OPD)
    kl = [r["ppo_actor/teacher_kl/avg"] for r in rows if "ppo_actor/teacher_kl/avg" in r]
    assert len(kl) == 12 and sum(kl[:3]) / 3 - sum(kl[-3:]) / 3 >= MIN_KL_FALL, kl
