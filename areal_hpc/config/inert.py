"""Options that do nothing in the mode a config runs in: none is taken silently (the honest-config rule).

Each rule names options, the options that decide their mode, and when they do nothing. An option set to other
than its idle value (its default; null for the checkpoint frequencies) where it does nothing is:
- an error, naming the file and line (or the override) that set it, when it was set after its mode was known:
  by the same layer as the options that decide it, or a later one (layers: the defaults, then each config
  file, then each override, in order);
- a warning, when a later file or override changed the mode: the earlier file is a base that set it for
  another mode (configs/toy-cpu.yaml under toy-sft.yaml). The resolved config then holds its idle value, so
  that the run's config.yaml says what the run uses;
- dropped silently when it is a default of ours (exp_ctrl.ckpt_freq_secs with recover_mode disabled).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from areal_hpc import alloc
from areal_hpc.config.checks import walk
from areal_hpc.config.schema import ExperimentConfig

logger = logging.getLogger(__name__)

CKPT_FREQS = ("exp_ctrl.ckpt_freq_epochs", "exp_ctrl.ckpt_freq_steps", "exp_ctrl.ckpt_freq_secs")
IDLE = dict.fromkeys(CKPT_FREQS)  # options whose idle value is not their default


@dataclass(frozen=True)
class Rule:
    options: tuple[str, ...]  # keys, or sections ending in '.' (every option under them)
    mode: tuple[str, ...]  # the options that decide whether they do anything
    idle: Callable[[ExperimentConfig], bool]  # True when they do nothing
    why: str


def _rl(cfg: ExperimentConfig) -> bool:
    return cfg.experiment_type == "ppo"


def _agent(cfg: ExperimentConfig) -> bool:
    return cfg.rollout.agent is not None or cfg.rollout.agent_command is not None


def _gen_backend(cfg: ExperimentConfig) -> str | None:
    try:
        return alloc.parse_allocation_mode(cfg.allocation_mode).gen_backend or cfg.colocated_gen_backend
    except alloc.AllocationError:
        return None  # the allocation check says why


RULES = (
    Rule(
        ("success_rate_lb", "success_rate_ub", "schedule_policy", "max_concurrent_rollouts",
         "max_head_offpolicyness", "n_rollout_workers", "interruptible_generation"),
        ("async_rl", "experiment_type"), lambda c: not (c.async_rl and _rl(c)),
        "it applies to the rollout role of asynchronous RL (async_rl: true, experiment_type: ppo)",
    ),
    Rule(
        ("async_rl",), ("experiment_type",), lambda c: not _rl(c),
        "a supervised warm-up (experiment_type: sft) generates no rollouts",
    ),
    Rule(
        ("ppo.ppo_n_minibatches", "ppo.eps_clip", "ppo.c_clip", "ppo.value_eps_clip", "ppo.early_stop_imp_ratio",
         "ppo.kl_ctl", "ppo.discount", "ppo.gae_lambda", "ppo.reward_output_scaling", "ppo.reward_output_bias",
         "ppo.max_reward_clip", "ppo.adv_norm", "ppo.group_adv_norm", "ppo.mask_no_eos_with_zero",
         "ppo.disable_value", "ppo.recompute_logprob", "ppo.use_decoupled_loss", "ppo.policy_loss",
         "ppo.eps_clip_higher", "ppo.loss_agg_mode", "ppo.group_baseline", "ppo.overlong_filter",
         "ppo.overlong_buffer", "ppo.prox_logp_method", "ppo.distill_coef", "group_size", "dynamic_sampling",
         "actor_inf."),
        ("experiment_type",), lambda c: not _rl(c),
        "it applies to RL (experiment_type: ppo); a supervised warm-up trains on the reference solutions",
    ),
    Rule(
        ("ppo.group_norm_level",), ("ppo.adv_norm", "ppo.group_adv_norm", "experiment_type"),
        lambda c: not (c.ppo.adv_norm and c.ppo.group_adv_norm and _rl(c)),
        "there is no group normalisation (ppo.adv_norm and ppo.group_adv_norm both true, experiment_type: ppo)",
    ),
    Rule(
        ("ppo.kl_estimator", "ppo.kl_in"), ("ppo.kl_ctl", "experiment_type"),
        lambda c: c.ppo.kl_ctl == 0 or not _rl(c),
        "there is no KL penalty (ppo.kl_ctl: 0, or experiment_type: sft)",
    ),
    Rule(
        ("ppo.overlong_penalty_factor",), ("ppo.overlong_buffer", "experiment_type"),
        lambda c: c.ppo.overlong_buffer is None or not _rl(c),
        "there is no soft overlong penalty (ppo.overlong_buffer: null, or experiment_type: sft)",
    ),
    Rule(
        ("ppo.recompute_logprob",), ("ppo.prox_logp_method", "experiment_type"),
        lambda c: c.ppo.prox_logp_method == "loglinear" and _rl(c),
        "ppo.prox_logp_method loglinear approximates the proximal logprobs instead of recomputing them",
    ),
    Rule(
        ("ppo.behav_correction.",), ("ppo.recompute_logprob", "ppo.use_decoupled_loss", "experiment_type"),
        lambda c: (c.ppo.recompute_logprob and not c.ppo.use_decoupled_loss) or not _rl(c),
        "the behaviour policy does not enter the loss with ppo.recompute_logprob true and ppo.use_decoupled_loss "
        "false (the recomputed logprobs are the old policy; use_decoupled_loss: true corrects stale samples), "
        "nor in a supervised warm-up",
    ),
    Rule(
        ("teacher.", "teacher_inf.", "ppo.distill_alone"), ("ppo.distill_coef", "experiment_type"),
        lambda c: not c.ppo.distill_coef > 0 or not _rl(c),
        "there is no on-policy distillation (ppo.distill_coef: 0, or experiment_type: sft)",
    ),
    Rule(
        ("dynamic_sampling_max_rounds",), ("dynamic_sampling", "experiment_type"),
        lambda c: not (c.dynamic_sampling and _rl(c)),
        "it applies to dynamic sampling (dynamic_sampling: true, experiment_type: ppo)",
    ),
    Rule(
        ("critic.", "critic_inf.", "critic_train."), ("ppo.disable_value", "experiment_type"),
        lambda c: c.ppo.disable_value or not _rl(c),
        "there is no critic (ppo.disable_value: true, or experiment_type: sft)",
    ),
    Rule(
        ("ref.", "ref_inf."), ("ppo.kl_ctl", "experiment_type"), lambda c: c.ppo.kl_ctl == 0 or not _rl(c),
        "there is no reference model (ppo.kl_ctl: 0, or experiment_type: sft)",
    ),
    Rule(
        ("exp_ctrl.eval_freq_epochs", "exp_ctrl.eval_freq_steps", "exp_ctrl.eval_freq_secs"),
        ("dataset.valid_path",), lambda c: not c.dataset.valid_path,
        "the held-out evaluation it schedules needs dataset.valid_path",
    ),
    Rule(
        (*CKPT_FREQS, "recover_retries", "recover_after", "recover_keep"), ("recover_mode",),
        lambda c: c.recover_mode == "disabled",
        "recover_mode is disabled: no recover checkpoint is written and no failed attempt restarted",
    ),
    Rule(
        ("weight_update_bucket_mb",), ("weight_update_mode",), lambda c: c.weight_update_mode != "broadcast",
        "it applies to weight_update_mode broadcast",
    ),
    Rule(("logging.wandb_mode",), ("logging.wandb",), lambda c: not c.logging.wandb, "logging.wandb is false"),
    Rule(
        ("sglang.log_level",), ("allocation_mode", "colocated_gen_backend"),
        lambda c: _gen_backend(c) not in ("sglang", None),
        "it applies to SGLang servers only, and the generation backend is another",
    ),
    Rule(
        ("cluster.gpu_memory_gib",), ("allocation_mode", "colocated_gen_backend", "experiment_type"),
        lambda c: _gen_backend(c) not in ("builtin", None) or not _rl(c),
        "it sizes the built-in server's KV cache at submission (generation backend builtin, experiment_type: ppo)",
    ),
    Rule(
        ("rollout.workflow",), ("experiment_type",), lambda c: not _rl(c),
        "a supervised warm-up (experiment_type: sft) runs no episodes",
    ),
    Rule(
        ("rollout.agent", "rollout.agent_command"), ("experiment_type",), lambda c: not _rl(c),
        "a supervised warm-up (experiment_type: sft) runs no episodes",
    ),
    Rule(
        ("rollout.export", "rollout.turn_discount", "rollout.episode_timeout_secs",
         "rollout.transcript_groups"),
        ("rollout.workflow", "rollout.agent", "rollout.agent_command", "experiment_type"),
        lambda c: (c.rollout.workflow == "single_turn" and not _agent(c)) or not _rl(c),
        "it applies to multi-turn workflows and agents (rollout.workflow other than single_turn, rollout.agent, "
        "rollout.agent_command)",
    ),
    Rule(
        ("rollout.agent_model", "rollout.agent_concurrency"),
        ("rollout.agent", "rollout.agent_command", "experiment_type"),
        lambda c: not _agent(c) or not _rl(c),
        "it applies to agents trained as they are (rollout.agent, rollout.agent_command), in RL",
    ),
    Rule(
        ("rollout.agent_output_bytes",), ("rollout.agent_command", "experiment_type"),
        lambda c: c.rollout.agent_command is None or not _rl(c),
        "it applies to the program of rollout.agent_command, in RL (experiment_type: ppo)",
    ),
    Rule(
        ("rollout.tools",), ("rollout.workflow", "experiment_type"),
        lambda c: c.rollout.workflow == "single_turn" and _rl(c),
        "it applies to workflows that call tools, and to warm-ups on worked conversations (docs/agents.md)",
    ),
    Rule(
        ("rollout.max_turns", "rollout.tool_time_secs", "rollout.python_state", "rollout.max_tool_output_chars"),
        ("rollout.workflow", "experiment_type"),
        lambda c: c.rollout.workflow == "single_turn" or not _rl(c),
        "it applies to workflows that call tools (tool_loop, or one of yours)",
    ),
    Rule(
        ("reward.fn_batch", "reward.fn_timeout_secs", "reward.fn_workers"), ("reward.fn",),
        lambda c: c.reward.fn is None, "it applies to reward.fn, which is not set",
    ),
    Rule(
        ("reward.code_time_secs", "reward.code_memory_mb", "reward.code_workers", "reward.code_isolation"),
        ("reward.fn",), lambda c: c.reward.fn is not None, "reward.fn scores every answer, code answers too",
    ),
    *(Rule(
        (f"{m}.recompute_layers",), (f"{m}.gradient_checkpointing",),
        lambda c, m=m: not getattr(c, m).gradient_checkpointing,
        f"{m}.gradient_checkpointing is false: no layer recomputes its activations",
    ) for m in ("actor", "critic")),
    Rule(
        ("actor.lora.alpha", "actor.lora.dropout", "actor.lora.target_modules"), ("actor.lora.rank",),
        lambda c: c.actor.lora.rank == 0, "the actor trains its full weights (actor.lora.rank 0)",
    ),
)  # fmt: skip


def settle(cfg: ExperimentConfig, set_at: dict[str, tuple[int, str]]) -> tuple[ExperimentConfig, list[str]]:
    """`cfg` with the idle value of every option that does nothing in its mode and may be dropped, and the
    problems of those that may not. `set_at`: the layer (0: the first file) and source of each key set."""
    problems, warned = [], {}
    for rule in RULES:
        if not rule.idle(cfg):
            continue
        mode_layer = max((set_at[k][0] for k in rule.mode if k in set_at), default=-1)
        for key, idle in _options(rule.options):
            if attrgetter(key)(cfg) == idle:
                continue
            layer, source = set_at.get(key, (-1, ""))
            if layer >= mode_layer and layer >= 0:
                problems.append(f"{source}: '{key}' does nothing here: {rule.why}; remove it")
                continue
            if layer >= 0:
                warned.setdefault((source.rsplit(":", 1)[0], rule.why), []).append(key)
            cfg = _replace(cfg, key, idle)
    for (where, why), keys in warned.items():
        logger.warning("%s sets %s, which do nothing in this run (%s): the run takes their defaults",
                       where, ", ".join(keys), why)  # fmt: skip
    return cfg, problems


def _options(names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, idle value) of every option `names` cover."""
    return [
        (key, IDLE.get(key, default))
        for key, default in _defaults().items()
        if any(key == n or (n.endswith(".") and key.startswith(n)) for n in names)
    ]


@functools.cache
def _defaults() -> dict[str, Any]:
    return {key: value for key, _, value in walk(ExperimentConfig())}


def _replace(cfg: Any, key: str, value: Any) -> Any:
    head, _, rest = key.partition(".")
    new = _replace(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: new})
