"""The algorithm's options: sampling, the policy loss, advantages, corrections, distillation.

Part of the schema (config/schema.py re-exports every class here): each field carries `help` in its metadata;
`choices` and the bounds `ge`, `gt`, `le`, `lt` are checked by `config.checks`, the rules between them there
and in `config.inert`.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hpc.config.fields import opt

# Every slot's stop table is as wide as the widest row's, and a banned row's sampling reads all of it: one
# request with the whole vocabulary as stop ids would slow every row of the batch (SGLang sets no limit).
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class GenerationConfig:
    max_new_tokens: int = opt(16384, "Longest answer generated, in tokens.", ge=1)
    min_new_tokens: int = opt(0, "Shortest answer generated, in tokens.", ge=0)
    temperature: float = opt(1.0, "Sampling temperature (also divides logits in training).", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    top_k: int = opt(-1, "Sample among the k most likely tokens; -1: all.", ge=-1)
    stop_token_ids: list[int] = opt(
        [], "Token ids that end an answer besides the tokenizer's EOS tokens (at most 1024)."
    )


@dataclass
class BehavCorrectionConfig:
    """The correction of samples from a stale behaviour policy mu (the servers' logprobs) against pi: the proximal
    policy when logprobs are recomputed (decoupled loss), else the current one (docs/algorithms.md)."""

    level: str = opt(
        "token",
        "token: each token is judged on its own; sequence: the answer as a whole, by the geometric mean of its "
        "ratios (metric ratio) or the mean of its k1/k2/k3.",
        choices=("token", "sequence"),
    )
    action: str = opt(
        "mask",
        "mask: a token (an answer) whose metric leaves [lower, upper] gets weight 0 (IcePop, sequence masking); "
        "clamp: the importance weight is clipped to [lower, upper] (truncated importance sampling; metric ratio).",
        choices=("mask", "clamp"),
    )
    metric: str = opt(
        "ratio",
        "What the bounds apply to: the ratio r = pi/mu, or a KL estimator as verl's rollout correction has it "
        "(tokens sampled from mu): k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 - log r.",
        choices=("ratio", "k1", "k2", "k3"),
    )
    lower: float | None = opt(None, "Lower bound of the metric; null: none.")
    upper: float | None = opt(
        5.0,
        "Upper bound of the metric; null: none (both null: the importance weight is used as it is).",
        gt=0,
    )


@dataclass
class PPOConfig:
    gen: GenerationConfig = opt(GenerationConfig, "Sampling of answers.")
    ppo_n_minibatches: int = opt(
        4, "Optimizer steps per training step (the batch is split into this many).", ge=1
    )
    policy_loss: str = opt(
        "ppo",
        "The policy loss: ppo (clipped token ratios), gspo (the clipped sequence ratio, the geometric mean of the "
        "answer's token ratios), gspo_token (GSPO's token variant: per-token advantages), cispo (REINFORCE on "
        "log pi weighted by the clipped, stop-gradient token ratio).",
        choices=("ppo", "gspo", "gspo_token", "cispo"),
    )
    eps_clip: float = opt(
        0.2, "PPO ratio clip: r is clipped to [1-eps, 1+eps] (1: no lower clip).", gt=0, le=1
    )
    eps_clip_higher: float | None = opt(
        None,
        "Upper clip: r is clipped to [1-eps_clip, 1+eps_clip_higher] (DAPO's clip-higher); null: eps_clip.",
        gt=0,
    )
    loss_agg_mode: str = opt(
        "token-mean",
        "How token losses make the loss, over the whole minibatch (all micro-batches and data-parallel ranks): "
        "token-mean, token-sum, seq-mean-token-mean (each answer's mean, then the mean over answers), "
        "seq-mean-token-sum, seq-mean-token-sum-norm (answer sums divided by ppo.gen.max_new_tokens: Dr.GRPO).",
        choices=(
            "token-mean",
            "token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        ),
    )
    c_clip: float | None = opt(None, "Dual-clip bound for negative advantages (> 1); null: off.", gt=1)
    value_eps_clip: float = opt(0.2, "Clip of the value update around the old value.", gt=0)
    early_stop_imp_ratio: float | None = opt(
        5.0,
        "Skip a minibatch update whose mean importance ratio, over all its tokens on every rank, exceeds this "
        "(the weights and optimizer state stay as they were); null: off.",
        gt=1,
    )
    kl_ctl: float = opt(
        0.1, "Weight of the per-token KL penalty to the reference model; 0 removes ref.", ge=0
    )
    kl_estimator: str = opt(
        "k1",
        "The KL estimator of the penalty, with rho = pi_ref/pi: k1 = -log rho, k2 = (log rho)^2/2, "
        "k3 = rho - 1 - log rho.",
        choices=("k1", "k2", "k3"),
    )
    kl_in: str = opt(
        "reward",
        "Where the KL penalty goes: reward (a per-token reward of the behaviour policy's tokens) or loss (a term "
        "of the actor loss on the current policy, aggregated as the policy loss is).",
        choices=("reward", "loss"),
    )
    discount: float = opt(1.0, "GAE discount gamma.", ge=0, le=1)
    gae_lambda: float = opt(1.0, "GAE lambda.", ge=0, le=1)
    reward_output_scaling: float = opt(5.0, "Reward = ((success - 0.5) * 2 - bias) * scaling.")
    reward_output_bias: float = opt(0.0, "Bias subtracted before scaling the reward.")
    max_reward_clip: float = opt(20.0, "Sequence rewards are clipped to [-clip, clip].", gt=0)
    group_baseline: str = opt(
        "none",
        "Baseline subtracted from each answer's reward before the advantages: none, mean (the mean of its "
        "prompt's group: Dr.GRPO, REINFORCE++-baseline) or leave_one_out (the mean of the others: RLOO).",
        choices=("none", "mean", "leave_one_out"),
    )
    adv_norm: bool = opt(True, "Normalise advantages over the valid tokens of the batch.")
    group_adv_norm: bool = opt(False, "Normalise advantages within each prompt's group (GRPO).")
    group_norm_level: str = opt(
        "answer",
        "What weighs the same in a group's mean and std: answer (GRPO, DAPO, GSPO: (R - mean R) / std R over the "
        "prompt's answers) or token (the original AReaL's: every answer token, so long answers weigh more).",
        choices=("answer", "token"),
    )
    mask_no_eos_with_zero: bool = opt(False, "Zero the reward of answers truncated without EOS.")
    overlong_filter: bool = opt(
        False, "Leave answers truncated without EOS out of the loss (DAPO's overlong filtering)."
    )
    overlong_buffer: float | None = opt(
        None,
        "DAPO's soft overlong penalty: the last this share of ppo.gen.max_new_tokens is a buffer (DAPO: "
        "4096/20480 = 0.2); an answer reaching into it loses overlong_penalty_factor times the part of the buffer "
        "it uses from its reward; null: off.",
        gt=0,
        lt=1,
    )
    overlong_penalty_factor: float = opt(1.0, "The soft overlong penalty of a full buffer.", gt=0)
    disable_value: bool = opt(True, "No critic: values are 0 and critic calls are removed.")
    recompute_logprob: bool = opt(True, "Recompute logprobs with the trainer before the update.")
    use_decoupled_loss: bool = opt(True, "Decoupled PPO objective for stale samples (proximal policy).")
    prox_logp_method: str = opt(
        "recompute",
        "The proximal policy of the decoupled loss: recompute (actor_inf, a forward pass) or loglinear (no "
        "forward pass: log pi_prox = log mu + a (log pi - log mu), a from each token's weight version, A-3PO).",
        choices=("recompute", "loglinear"),
    )
    behav_correction: BehavCorrectionConfig = opt(
        BehavCorrectionConfig, "Correction of stale samples (off-policy correction of the behaviour policy)."
    )
    distill_coef: float = opt(
        0.0,
        "On-policy distillation: weight of the per-token advantage log pi_teacher - log pi (the reverse KL to "
        "teacher.path); 0: off.",
        ge=0,
    )
    distill_alone: bool = opt(
        False, "On-policy distillation: the distillation advantage alone, without the task reward's."
    )
