"""What a trainer rank does for each model function call (MFC) on its data-parallel part of a batch.

The actor's calls go through its interface (PPOActor, SFTActor, or the user's `actor.interface`); the
reference policy's and the critic's through the functions here.

Inputs are dicts of numpy arrays as ``data.batch.read_batch`` returns them: this rank's sequences, packed (the
batch keys of docs/architecture.md). Inference returns the new per-token arrays for ``write_batch``. A train step
returns statistics under the original's names, reduced over the data-parallel ranks, so every rank returns the
same dict. Train steps run collectives: every rank of the group must make the same call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import numpy as np
import torch

from areal_hpc.algo import (
    Correction,
    Overlong,
    Totals,
    actor_loss,
    compute_advantages,
    critic_loss,
    local_totals,
    loglinear_proximal,
    response_mask,
)
from areal_hpc.config import ExperimentConfig, MicroBatchSpec, PPOConfig, extensions
from areal_hpc.data import CU
from areal_hpc.train import dist
from areal_hpc.train.backends import TrainEngine
from areal_hpc.train.microbatch import micro_batches, minibatches
from areal_hpc.train.numerics import LossFn
from areal_hpc.train.stats import StatsTracker

Batch = Mapping[str, np.ndarray]

ACTOR_TOTALS = (
    "n_tokens",
    "n_valid_tokens",
    "clipped_tokens",
    "dual_clipped_tokens",
    "unclipped_behave_tokens",
)


# --- inference ----------------------------------------------------------------------------------------------


def actor_inference(
    engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec, temperature: float
) -> dict[str, np.ndarray]:
    """actor_inf: ``proximal_logprobs`` under the current weights (logits divided by the generation
    temperature)."""
    return {"proximal_logprobs": engine.logprobs(batch, temperature, mb_spec).numpy()}


def ref_inference(
    engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec, temperature: float
) -> dict[str, np.ndarray]:
    """ref_inf: ``packed_ref_logprobs`` of the reference model (same temperature as the actor)."""
    return {"packed_ref_logprobs": engine.logprobs(batch, temperature, mb_spec).numpy()}


def teacher_inference(
    engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec, temperature: float
) -> dict[str, np.ndarray]:
    """teacher_inf: ``packed_teacher_logprobs`` of the distillation teacher (same temperature as the actor)."""
    return {"packed_teacher_logprobs": engine.logprobs(batch, temperature, mb_spec).numpy()}


def critic_inference(engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec) -> dict[str, np.ndarray]:
    """critic_inf: ``values`` of the prefix ending at each token."""
    return {"values": engine.values(batch, mb_spec).numpy()}


# --- shared by the train steps ------------------------------------------------------------------------------


def old_logprob_key(ppo: PPOConfig) -> str:
    """The batch key actor_train takes old logprobs from: the recomputed ones when the objective is not
    decoupled, otherwise the behaviour policy's (the proximal ones then enter as the proximal policy)."""
    return "proximal_logprobs" if ppo.recompute_logprob and not ppo.use_decoupled_loss else "packed_logprobs"


def recomputed_proximal(ppo: PPOConfig) -> bool:
    """The decoupled loss with the proximal logprobs of actor_inf (not approximated)."""
    return ppo.use_decoupled_loss and ppo.prox_logp_method == "recompute"


def correction_of(ppo: PPOConfig) -> Correction | None:
    """The behaviour correction, where the behaviour policy enters the loss (decoupled, or old logprobs that
    are the behaviour policy's)."""
    if old_logprob_key(ppo) != "packed_logprobs":
        return None
    c = ppo.behav_correction
    return Correction(c.level, c.action, c.metric, c.lower, c.upper)


def _require(batch: Batch, keys: Iterable[str], what: str) -> None:
    missing = sorted(set(keys) - set(batch))
    if missing:
        raise KeyError(f"{what} needs batch keys {missing}; the batch holds {sorted(batch)}")


def _advantages(
    batch: Batch, ppo: PPOConfig, *, use_values: bool, adv_norm: bool, group=None
) -> dict[str, torch.Tensor]:
    """``compute_advantages`` on this rank's batch; the batch-wide normalisation spans the data-parallel ranks
    (``group``; None: all ranks)."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}
    kl = ppo.kl_ctl != 0 and ppo.kl_in == "reward"
    grouped = (adv_norm and ppo.group_adv_norm) or ppo.group_baseline != "none"
    buffer = round(ppo.overlong_buffer * ppo.gen.max_new_tokens) if ppo.overlong_buffer else 0
    return compute_advantages(
        scores=t["rewards"],
        prompt_mask=t["prompt_mask"],
        cu_seqlens=t[CU],
        seq_no_eos_mask=t["seq_no_eos_mask"],
        logp_behav=t[old_logprob_key(ppo)] if kl or ppo.distill_coef else None,
        logp_ref=t["packed_ref_logprobs"] if kl else None,
        values=t["values"] if use_values else None,
        kl_ctl=ppo.kl_ctl if kl else 0.0,
        kl_estimator=ppo.kl_estimator,
        discount=ppo.discount,
        gae_lambda=ppo.gae_lambda,
        max_reward_clip=ppo.max_reward_clip,
        mask_no_eos_with_zero=ppo.mask_no_eos_with_zero,
        baseline=ppo.group_baseline,
        adv_norm=adv_norm,
        group_adv_norm=ppo.group_adv_norm,
        group_norm_level=ppo.group_norm_level,
        group_ids=t["group_ids"] if grouped else None,
        overlong=Overlong(ppo.gen.max_new_tokens, buffer, ppo.overlong_penalty_factor) if buffer else None,
        overlong_filter=ppo.overlong_filter,
        logp_teacher=t["packed_teacher_logprobs"] if ppo.distill_coef else None,
        distill_coef=ppo.distill_coef,
        distill_alone=ppo.distill_alone,
        # Not algo's dist_sum: NCCL cannot reduce these CPU tensors; ours moves them to the GPU and back.
        reduce_fn=partial(dist.all_reduce_sum, group=group),
    )


def answer_versions(batch: Batch) -> np.ndarray:
    """Each token's weight version when the batch records only its answers' (single-turn): the version the
    answer started at (an interrupted answer's later parts are newer: a lower bound)."""
    starts = np.asarray(batch["version_start"], dtype=np.int64)
    return np.repeat(starts, np.diff(np.asarray(batch[CU], dtype=np.int64)))


def _rl_keys(ppo: PPOConfig, *, values: bool) -> list[str]:
    keys = ["packed_input_ids", "prompt_mask", "rewards", "seq_no_eos_mask", old_logprob_key(ppo)]
    keys += ["packed_ref_logprobs"] if ppo.kl_ctl != 0 else []
    keys += ["packed_teacher_logprobs"] if ppo.distill_coef else []
    keys += ["group_ids"] if ppo.group_baseline != "none" or (ppo.adv_norm and ppo.group_adv_norm) else []
    keys += ["values"] if values else []
    return keys


def _sequence_stats(tracker: StatsTracker, batch: Batch, global_step: int | None) -> None:
    """Per-sequence statistics of the batch as the rollout left it."""
    cu = np.asarray(batch[CU], dtype=np.int64)
    every = torch.ones(len(cu) - 1, dtype=torch.bool)
    prompt_len = np.add.reduceat(np.asarray(batch["prompt_mask"], dtype=np.int64), cu[:-1])
    # task_reward is the answer's correctness (0/1) when the rollout recorded it; reward is the scaled score.
    per_seq = {
        "task_reward": batch["success"] if "success" in batch else batch["rewards"],
        "reward": batch["rewards"],
        "seq_len": np.diff(cu),
        "prompt_len": prompt_len,
        "no_eos_ratios": batch["seq_no_eos_mask"],
    }
    if global_step is not None and "version_start" in batch and "version_end" in batch:
        per_seq["head_offpolicyness"] = global_step - np.asarray(batch["version_start"])
        per_seq["tail_offpolicyness"] = global_step - np.asarray(batch["version_end"])
    for name, values in per_seq.items():
        tracker.masked(name, torch.from_numpy(np.asarray(values, dtype=np.float64)), every)
    tracker.total("n_seqs", len(cu) - 1)


def _token_stats(tracker: StatsTracker, batch: Batch, loss_mask: np.ndarray, global_step: int | None) -> None:
    """Per-token off-policyness of the trained tokens: a multi-turn episode spans weight updates, so its
    sequence-level head/tail off-policyness says little about the turns between."""
    if global_step is None or "token_versions" not in batch:
        return
    versions = np.asarray(batch["token_versions"], dtype=np.int64)
    unversioned = int((versions[loss_mask] < 0).sum())
    if unversioned:  # -1 marks tokens the policy did not sample: the rollout's masks and versions disagree
        raise ValueError(f"token_versions: {unversioned} trained tokens have no weight version (-1)")
    lag = torch.from_numpy((global_step - versions).astype(np.float64))
    tracker.masked("token_offpolicyness", lag, torch.from_numpy(loss_mask))


def _minibatch_totals(part: Batch | None, group) -> Totals:
    """The valid tokens and the sequences with one of a minibatch, over all data-parallel ranks."""
    local = torch.zeros(2, dtype=torch.float64)
    if part is not None:
        local = local_totals(torch.from_numpy(part["loss_mask"]), torch.from_numpy(part[CU]))
    return Totals(*dist.all_reduce_sum(local, group).tolist())


class EarlyStop:
    """``ppo.early_stop_imp_ratio``: a minibatch whose mean importance ratio, over all its valid tokens on every
    rank, exceeds ``bound`` is not applied. Judged once the whole minibatch's ratios are known, so the step is
    the same however the minibatch is cut into micro-batches and ranks."""

    def __init__(self, bound: float):
        self.bound, self.sums = bound, torch.zeros(2, dtype=torch.float64)
        self.stopped = False  # the last minibatch's verdict

    def add(self, stats: Mapping) -> None:
        """A micro-batch's ratios (``actor_loss``'s ``importance_weight``)."""
        ratio, mask = stats["importance_weight"]
        self.sums += torch.stack([torch.where(mask, ratio.double(), 0.0).sum(), mask.sum().double()]).cpu()

    def __call__(self) -> bool:
        """Whether to skip this minibatch's step: a collective of every trainer rank (ranks without losses, as
        earlier pipeline stages, add zeros; tensor-parallel copies scale both sums alike)."""
        total, count = dist.all_reduce_sum(self.sums).tolist()
        self.sums.zero_()
        self.stopped = count > 0 and total / count > self.bound
        return self.stopped


def _train_minibatches(
    engine: TrainEngine,
    batch: Batch,
    n_minibatches: int,
    mb_spec: MicroBatchSpec,
    make_loss_fn: Callable[[Totals], LossFn],
    tracker: StatsTracker,
    temperature: float = 1.0,
    early_stop: EarlyStop | None = None,
) -> None:
    """One optimizer step per minibatch; each loss is normalised by the minibatch's totals on all ranks."""
    for part in minibatches(batch, n_minibatches):
        totals = _minibatch_totals(part, engine.dp_group)
        mbs = [] if part is None else micro_batches(part, mb_spec)
        step = engine.train_minibatch(mbs, make_loss_fn(totals), temperature, early_stop)
        if early_stop is not None:
            tracker.mean("early_stopped", float(early_stop.stopped))
        tracker.mean("grad_norm", step["grad_norm"])
        tracker.mean("lr", step["lr"])
        for key in sorted(step.keys() - {"loss", "grad_norm", "lr"}):  # an engine's own (megatron's moe/*)
            tracker.mean(key, step[key])


# --- train steps --------------------------------------------------------------------------------------------


def actor_train_step(
    engine: TrainEngine,
    batch: Batch,
    ppo: PPOConfig,
    mb_spec: MicroBatchSpec,
    *,
    global_step: int | None = None,
) -> dict[str, float]:
    """actor_train: advantages, then ``ppo_n_minibatches`` PPO updates; statistics under ``ppo_actor/``.

    ``global_step`` (with ``version_start``/``version_end`` in the batch) adds head/tail off-policyness, and
    with ``token_versions`` the off-policyness of each trained token (``token_offpolicyness``).
    ``prompt_mask`` marks every token the policy did not sample (prompt, tool results, user turns), anywhere in
    a sequence: none of them is trained on or enters the KL penalty and the per-token statistics.
    Group normalisation (``group_adv_norm``) needs each prompt's whole group on this rank.
    """
    recomputed = recomputed_proximal(ppo)
    loglinear = ppo.use_decoupled_loss and ppo.prox_logp_method == "loglinear"
    keys = _rl_keys(ppo, values=not ppo.disable_value) + (["proximal_logprobs"] if recomputed else [])
    keys += ["version_start"] if loglinear else []
    _require(batch, keys, "actor_train")
    if loglinear and global_step is None:
        raise ValueError(
            "prox_logp_method loglinear needs the train step's global_step (the proximal version)"
        )
    adv = _advantages(
        batch, ppo, use_values=not ppo.disable_value, adv_norm=ppo.adv_norm, group=engine.dp_group
    )
    data = {**batch, "advantages": adv["advantages"].numpy(), "loss_mask": adv["loss_mask"].numpy()}
    if loglinear and "token_versions" not in data:
        data["token_versions"] = answer_versions(batch)
    old_key = old_logprob_key(ppo)
    correction = correction_of(ppo)
    early_stop = None if ppo.early_stop_imp_ratio is None else EarlyStop(ppo.early_stop_imp_ratio)
    kl_loss = ppo.kl_ctl if ppo.kl_in == "loss" else 0.0
    tracker = StatsTracker()
    _sequence_stats(tracker, batch, global_step)
    _token_stats(tracker, batch, data["loss_mask"], global_step)
    if ppo.distill_coef:  # the sampled tokens' reverse KL to the teacher (k1): what distillation lowers
        reverse_kl = np.asarray(batch[old_key], np.float64) - np.asarray(batch["packed_teacher_logprobs"])
        tracker.masked("teacher_kl", torch.from_numpy(reverse_kl), torch.from_numpy(data["loss_mask"]))

    def make_loss_fn(totals: Totals) -> LossFn:
        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            proximal = mb["proximal_logprobs"] if recomputed else None
            if loglinear:
                proximal = loglinear_proximal(mb[old_key], out["logprobs"], mb["token_versions"], global_step)
            loss, stats = actor_loss(
                out["logprobs"],
                mb[old_key],
                mb["advantages"],
                mb["loss_mask"],
                cu_seqlens=mb[CU],
                policy_loss=ppo.policy_loss,
                eps_clip=ppo.eps_clip,
                eps_clip_higher=ppo.eps_clip_higher,
                c_clip=ppo.c_clip,
                proximal_logprobs=proximal,
                correction=correction,
                loss_agg_mode=ppo.loss_agg_mode,
                totals=totals,
                norm_len=ppo.gen.max_new_tokens,
                ref_logprobs=mb["packed_ref_logprobs"] if kl_loss else None,
                kl_coef=kl_loss,
                kl_estimator=ppo.kl_estimator,
            )
            tracker.add(stats, totals=ACTOR_TOTALS)
            tracker.masked("entropy", out["entropy"].detach(), mb["loss_mask"])
            if early_stop is not None:
                early_stop.add(stats)
            return loss

        return loss_fn

    temperature = ppo.gen.temperature
    _train_minibatches(
        engine, data, ppo.ppo_n_minibatches, mb_spec, make_loss_fn, tracker, temperature, early_stop
    )
    return tracker.reduce("ppo_actor", engine.dp_group)


def critic_train_step(
    engine: TrainEngine, batch: Batch, ppo: PPOConfig, mb_spec: MicroBatchSpec
) -> dict[str, float]:
    """critic_train: clipped value loss towards the GAE returns, ``ppo_n_minibatches`` updates; ``ppo_critic/``."""
    _require(batch, _rl_keys(ppo, values=True), "critic_train")
    adv = _advantages(
        batch, ppo, use_values=True, adv_norm=False, group=engine.dp_group
    )  # returns do not depend on normalisation
    data = {**batch, "returns": adv["returns"].numpy(), "loss_mask": adv["loss_mask"].numpy()}
    tracker = StatsTracker()

    def make_loss_fn(totals: Totals) -> LossFn:
        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, stats = critic_loss(
                out["values"],
                mb["values"],
                mb["returns"],
                mb["loss_mask"],
                value_eps_clip=ppo.value_eps_clip,
                loss_normalizer=max(totals.tokens, 1.0),
            )
            tracker.add(stats, totals=("n_tokens", "n_valid_tokens"))
            return loss

        return loss_fn

    _train_minibatches(engine, data, ppo.ppo_n_minibatches, mb_spec, make_loss_fn, tracker)
    return tracker.reduce("ppo_critic", engine.dp_group)


def sft_train_step(engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec) -> dict[str, float]:
    """sft_train: one optimizer step of next-token NLL on the answer tokens (``prompt_mask`` False), normalised
    by the answer tokens of all ranks. Returns ``sft/loss`` (mean NLL before the update), ``sft/ppl``,
    ``sft/n_tokens``, ``sft/grad_norm`` and ``sft/lr``."""
    _require(batch, ["packed_input_ids", "prompt_mask"], "sft_train")
    mask = response_mask(torch.from_numpy(np.asarray(batch["prompt_mask"])), torch.from_numpy(batch[CU]))
    data = {**batch, "loss_mask": mask.numpy()}
    tracker = StatsTracker()
    tracker.total("n_tokens", mask.sum())

    def make_loss_fn(totals: Totals) -> LossFn:
        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            nll = torch.where(mb["loss_mask"], -out["logprobs"], 0.0).sum()
            tracker.total("nll", nll)
            return nll / max(totals.tokens, 1.0)

        return loss_fn

    _train_minibatches(engine, data, 1, mb_spec, make_loss_fn, tracker)
    stats = tracker.reduce(group=engine.dp_group)
    if "nll" not in stats:  # a pipeline stage before the last computes no loss (the master reads the last's)
        return {}
    loss = stats["nll"] / max(stats["n_tokens"], 1.0)
    return {
        "sft/loss": loss,
        "sft/ppl": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
        "sft/n_tokens": stats["n_tokens"],
        "sft/grad_norm": stats["grad_norm"],
        "sft/lr": stats["lr"],
    }


# --- the actor's interface (actor.interface) ------------------------------------------------------------------


class PPOActor:
    """The actor's built-in interface ('ppo_actor'): what a trainer rank runs on actor_inf and actor_train.

    An interface of the user's (`actor.interface: my_pkg.algo:MyActor`) is built the same way, with the run's
    config, and has the same two methods; subclassing this one and changing what differs is the short way.
    """

    def __init__(self, cfg: ExperimentConfig):
        self.ppo = cfg.ppo

    def inference(self, engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec) -> dict[str, np.ndarray]:
        """actor_inf: the per-token arrays it adds to the batch (``proximal_logprobs``)."""
        return actor_inference(engine, batch, mb_spec, self.ppo.gen.temperature)

    def train_step(
        self, engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec, global_step: int | None = None
    ) -> dict[str, float]:
        """actor_train: the update, and its statistics (the same dict on every rank)."""
        return actor_train_step(engine, batch, self.ppo, mb_spec, global_step=global_step)


class SFTActor:
    """The actor's interface under experiment_type sft ('sft'): sft_train only."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg

    def inference(self, engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec) -> dict[str, np.ndarray]:
        raise ValueError("supervised training runs no inference call")

    def train_step(
        self, engine: TrainEngine, batch: Batch, mb_spec: MicroBatchSpec, global_step: int | None = None
    ) -> dict[str, float]:
        return sft_train_step(engine, batch, mb_spec)


def actor_interface(cfg: ExperimentConfig):
    """The actor's interface object the config names (actor.interface; null: the experiment type's)."""
    spec = cfg.actor.interface or {"ppo": "ppo_actor", "sft": "sft"}[cfg.experiment_type]
    return extensions.load("actor.interface", spec)(cfg)
