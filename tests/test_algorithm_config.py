"""The algorithm's options: presets layered over a recipe, the combinations refused, the options that do nothing."""

import re
from operator import attrgetter
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs/toy-cpu.yaml"
QWEN = ROOT / "configs/qwen3-1.7b-8gpu.yaml"
ALGORITHMS = ROOT / "configs/algorithms"

# What each preset promises, whatever the recipe under it says.
PRESETS = {
    "grpo": {
        "ppo.group_adv_norm": True,
        "ppo.group_norm_level": "answer",
        "ppo.adv_norm": True,
        "ppo.group_baseline": "none",
        "ppo.kl_ctl": 0.0,
    },
    "dr_grpo": {
        "ppo.group_baseline": "mean",
        "ppo.adv_norm": False,
        "ppo.group_adv_norm": False,
        "ppo.loss_agg_mode": "seq-mean-token-sum-norm",
    },
    "dapo": {
        "ppo.eps_clip": 0.2,
        "ppo.eps_clip_higher": 0.28,
        "ppo.group_norm_level": "answer",
        "dynamic_sampling": True,
        "ppo.overlong_buffer": 0.2,
        "ppo.reward_output_scaling": 1.0,
    },
    "gspo": {
        "ppo.policy_loss": "gspo",
        "ppo.eps_clip": 3e-4,
        "ppo.eps_clip_higher": 4e-4,
        "ppo.loss_agg_mode": "seq-mean-token-mean",
        "ppo.group_norm_level": "answer",
    },
    "cispo": {
        "ppo.policy_loss": "cispo",
        "ppo.eps_clip": 1.0,
        "ppo.eps_clip_higher": 0.28,
        "ppo.group_norm_level": "answer",
        "ppo.behav_correction.action": "clamp",  # every token keeps its gradient
    },
    "rloo": {"ppo.group_baseline": "leave_one_out", "ppo.adv_norm": False, "ppo.group_adv_norm": False},
    "reinforce_pp": {
        "ppo.group_baseline": "none",
        "ppo.kl_ctl": 0.01,
        "ppo.kl_in": "reward",
        "ppo.adv_norm": True,
    },
    "reinforce_pp_baseline": {"ppo.group_baseline": "mean", "ppo.kl_ctl": 0.01, "ppo.group_adv_norm": False},
    "opd": {"ppo.distill_coef": 1.0, "ppo.distill_alone": True, "teacher.path": "/models/teacher"},
}
# What the user adds to a preset: the teacher; on a pipelined layout, a backend for the extra model.
USER = {"opd": ["teacher.path=/models/teacher"]}
PIPELINED = {"opd": ["teacher.backend=megatron"], "reinforce_pp": ["ref.backend=megatron"]}
PIPELINED["reinforce_pp_baseline"] = PIPELINED["reinforce_pp"]


def test_every_preset_is_tested_and_names_its_paper():
    assert {p.stem for p in ALGORITHMS.glob("*.yaml")} == set(PRESETS)
    for path in ALGORITHMS.glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and ("arXiv" in first or "Thinking Machines" in first), first


@pytest.mark.parametrize("recipe", [TOY, QWEN], ids=lambda p: p.stem)
@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_over_a_recipe_gives_the_algorithm(name, recipe):
    extra = PIPELINED.get(name, []) if recipe == QWEN else []
    cfg = load_config([recipe, ALGORITHMS / f"{name}.yaml"], USER.get(name, []) + extra)
    for key, value in PRESETS[name].items():
        assert attrgetter(key)(cfg) == value, key
    assert cfg.ppo.disable_value


def test_opd_without_a_teacher_is_refused_naming_teacher_path():
    with pytest.raises(
        ConfigError, match=r"'teacher.path' is not set: on-policy distillation needs teacher.path"
    ):
        load_config([TOY, ALGORITHMS / "opd.yaml"])


def test_a_preset_under_a_later_warm_up_is_a_base_whose_options_are_dropped(caplog):
    """toy-sft.yaml turns the run supervised: dapo.yaml's RL options then do nothing, and the run says so."""
    cfg = load_config([TOY, ALGORITHMS / "dapo.yaml", ROOT / "configs/toy-sft.yaml"])
    assert (cfg.dynamic_sampling, cfg.ppo.eps_clip_higher, cfg.ppo.overlong_buffer) == (False, None, None)
    assert any(
        "dapo.yaml sets" in r.getMessage() and "dynamic_sampling" in r.getMessage() for r in caplog.records
    )


# Combinations that cannot work, over toy-cpu.yaml (group_size 8, group_adv_norm true, max_new_tokens 16).
REFUSED = [
    (
        ["ppo.policy_loss=gspo"],
        "'ppo.policy_loss' gspo has one loss per answer",
        "ppo.loss_agg_mode=seq-mean-token-mean",
    ),
    (["ppo.distill_coef=0.5"], "'ppo.distill_coef' is 0.5, but 'teacher.path' is not set"),
    (
        ["ppo.use_decoupled_loss=false", "ppo.prox_logp_method=loglinear"],
        "'ppo.prox_logp_method' loglinear",
        "'ppo.use_decoupled_loss' is false",
    ),
    (
        ["ppo.behav_correction.action=clamp", "ppo.behav_correction.metric=k3"],
        "'ppo.behav_correction.action' clamp clips the importance weight, but 'ppo.behav_correction.metric' is k3",
    ),
    (
        ["ppo.behav_correction.action=clamp", "ppo.behav_correction.upper=null"],
        "'ppo.behav_correction.lower' and 'ppo.behav_correction.upper' are both null: nothing to clamp",
    ),
    (
        ["ppo.behav_correction.lower=6"],
        "'ppo.behav_correction.lower' (6.0) is not below 'ppo.behav_correction.upper'",
    ),
    (
        ["ppo.behav_correction.lower=-0.5"],
        "'ppo.behav_correction.lower' is -0.5, but 'ppo.behav_correction.metric'",
    ),
    (
        ["ppo.group_adv_norm=false", "group_size=1", "ppo.group_baseline=leave_one_out"],
        "'ppo.group_baseline' leave_one_out needs 'group_size' >= 2",
    ),
    (["ppo.group_baseline=mean"], "'ppo.group_baseline' mean with 'ppo.group_adv_norm' true"),
    (["ppo.policy_loss=cispo", "ppo.c_clip=3"], "'ppo.c_clip' (dual clip) bounds the PPO loss"),
    (
        ["ppo.recompute_logprob=false", "ppo.use_decoupled_loss=false", "ppo.policy_loss=cispo"],
        "'ppo.policy_loss' cispo keeps a gradient on every token, but 'ppo.behav_correction.action' mask",
        "ppo.behav_correction.action=clamp",
    ),
    (
        ["ppo.overlong_buffer=0.02"],
        "'ppo.overlong_buffer' 0.02 of 'ppo.gen.max_new_tokens' 16 is less than one token",
    ),
    (
        ["ppo.group_adv_norm=false", "group_size=1", "dynamic_sampling=true"],
        "'dynamic_sampling' drops the groups",
    ),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda case: case[0][-1].split("=")[0])
def test_a_combination_that_cannot_work_is_refused_naming_its_fields(case):
    overrides, *messages = case
    with pytest.raises(ConfigError) as err:
        load_config([TOY], overrides)
    for message in messages:
        assert message in str(err.value)


def test_all_algorithm_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config([TOY], ["ppo.policy_loss=gspo", "ppo.group_baseline=mean", "ppo.distill_coef=1"])
    assert all(
        key in str(err.value) for key in ("'ppo.policy_loss'", "'ppo.group_baseline'", "'teacher.path'")
    )


# One option of each rule of config/inert.py about the algorithm, set where it does nothing (over toy-cpu.yaml:
# kl_ctl 0, synchronous RL).
DOES_NOTHING = [
    ("ppo.kl_estimator=k3", "there is no KL penalty (ppo.kl_ctl: 0"),
    ("ppo.kl_in=loss", "there is no KL penalty"),
    ("dynamic_sampling_max_rounds=8", "it applies to dynamic sampling"),
    ("teacher.path=/models/teacher", "there is no on-policy distillation"),
    ("teacher_inf.mb_spec.n_mbs=2", "there is no on-policy distillation"),
    ("ppo.distill_alone=true", "there is no on-policy distillation (ppo.distill_coef: 0"),
    ("ppo.overlong_penalty_factor=0.5", "there is no soft overlong penalty"),
    ("ppo.prox_logp_method=loglinear", "ppo.recompute_logprob=false", "loglinear approximates the proximal"),
    (
        "ppo.use_decoupled_loss=false",
        "ppo.behav_correction.upper=2",
        "the behaviour policy does not enter the loss",
    ),
    ("ppo.group_adv_norm=false", "ppo.group_norm_level=token", "there is no group normalisation"),
    ("experiment_type=sft", "ppo.policy_loss=cispo", "it applies to RL (experiment_type: ppo)"),
    ("experiment_type=sft", "dynamic_sampling=true", "it applies to RL (experiment_type: ppo)"),
]


@pytest.mark.parametrize("case", DOES_NOTHING, ids=lambda case: case[-2].split("=")[0])
def test_an_algorithm_option_that_does_nothing_is_refused_naming_the_rule(case):
    *overrides, why = case
    with pytest.raises(ConfigError) as err:
        load_config([TOY], overrides)
    key = overrides[-1].split("=")[0]
    assert f"override '{overrides[-1]}': '{key}' does nothing here: " in str(err.value)
    assert why in str(err.value)


def test_the_removed_behav_imp_weight_cap_is_refused_with_its_replacement(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("ppo:\n  kl_ctl: 0.0\n  behav_imp_weight_cap: 2.0\n")
    replacement = (
        "replaced by ppo.behav_correction: a cap X is {level: token, action: mask, metric: ratio, upper: X} "
        "(the default, X = 5.0); null is behav_correction.upper: null"
    )
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}:3: 'ppo.behav_imp_weight_cap' is not an option")
    ) as err:
        load_config([path])
    assert replacement in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(replacement)):
        load_config(overrides=["ppo.behav_imp_weight_cap=null"])
