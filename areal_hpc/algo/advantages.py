"""Rewards, GAE advantages and advantage normalisation on packed sequences (REFERENCE section 5).

All per-token tensors are token-aligned with length T (see ``areal_hpc.algo.packing``): position t
holds the quantity of the action that emitted token t. ``values[t]`` is the critic's value of the
prefix ending at token t, so the state *before* action t has value ``values[t-1]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from areal_hpc.algo.corrections import kl_estimate
from areal_hpc.algo.packing import AlgoInputError, check_cu_seqlens, first_token_mask, seq_index

GROUP_NORM_LEVELS = ("answer", "token")

# Sums a tensor elementwise across data-parallel ranks and returns the result.
Reducer = Callable[[torch.Tensor], torch.Tensor]


def dist_sum(group: torch.distributed.ProcessGroup | None = None) -> Reducer:
    """A ``Reducer`` that all-reduces (sum) over ``group`` when torch.distributed is initialised.

    NCCL reduces only GPU tensors, so a CPU tensor makes a round trip through the current GPU.
    """

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return x
        on = x.device
        if torch.distributed.get_backend(group) == "nccl" and on.type != "cuda":
            x = x.to(torch.device("cuda", torch.cuda.current_device()))
        else:
            x = x.clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM, group=group)
        return x.to(on)

    return reduce


def _check_same_length(cu: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and (t.dim() != 1 or t.shape[0] != cu[-1].item()):
            raise AlgoInputError(
                f"{name} must be 1-D of length T={cu[-1].item()}, got shape {tuple(t.shape)}"
            )


def _check_per_seq(cu: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 1 or t.shape[0] != len(cu) - 1:
            raise AlgoInputError(
                f"{name} must be 1-D with one entry per sequence (B={len(cu) - 1}), got {tuple(t.shape)}"
            )


def response_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The loss mask: response tokens only (never the first token of a sequence, which has no logprob)."""
    cu = check_cu_seqlens(cu_seqlens, total=prompt_mask.shape[0])
    return ~prompt_mask.bool() & ~first_token_mask(cu)


def token_rewards(
    scores: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_no_eos_mask: torch.Tensor,
    *,
    logp_behav: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_ctl: float = 0.1,
    kl_estimator: str = "k1",
    max_reward_clip: float = 20.0,
    mask_no_eos_with_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: KL penalty on response tokens plus the clipped sequence score at the last token.

    ``scores`` (B) are the already scaled task rewards. Returns ``(rewards, kl_rewards)``, both length T,
    where ``kl_rewards = -kl_ctl * k(logp_behav, logp_ref)`` on ``loss_mask`` and 0 elsewhere (k: the
    ``kl_estimator``; k1 is ``logp_behav - logp_ref``). The logprobs may be omitted when ``kl_ctl == 0``.
    """
    cu = check_cu_seqlens(cu_seqlens, total=loss_mask.shape[0])
    _check_same_length(cu, logp_behav=logp_behav, logp_ref=logp_ref)
    _check_per_seq(cu, scores=scores, seq_no_eos_mask=seq_no_eos_mask)
    if max_reward_clip <= 0:
        raise AlgoInputError(f"max_reward_clip must be positive, got {max_reward_clip}")
    if kl_ctl != 0 and (logp_behav is None or logp_ref is None):
        raise AlgoInputError(f"kl_ctl={kl_ctl} needs both logp_behav and logp_ref")

    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if kl_ctl != 0:
        kl = kl_estimate(logp_behav, logp_ref, kl_estimator)
        kl_rewards = torch.where(loss_mask.bool(), -kl_ctl * kl, 0.0).to(dtype)
    else:
        kl_rewards = torch.zeros(loss_mask.shape[0], dtype=dtype, device=loss_mask.device)
    score = scores.to(dtype).clamp(-max_reward_clip, max_reward_clip)
    if mask_no_eos_with_zero:
        score = torch.where(seq_no_eos_mask.bool(), 0.0, score)
    rewards = kl_rewards.clone()
    rewards[cu[1:] - 1] += score
    return rewards, kl_rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    seq_no_eos_mask: torch.Tensor,
    *,
    discount: float = 1.0,
    gae_lambda: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over packed sequences; returns ``(advantages, returns)``.

    For action t of a sequence ending at e (exclusive), with V(before t) = ``values[t-1]``:
    ``delta_t = rewards[t] + discount * next_t - values[t-1]``, where ``next_t = values[t]``, except at
    the last token of a sequence that ended with EOS, where it is 0 (only truncated sequences bootstrap).
    ``A_t = delta_t + discount * gae_lambda * A_{t+1}``; ``returns = A + values[t-1]``. ``values=None``
    means all values are 0 (``disable_value``). The first slot of each sequence gets 0 in both outputs.
    """
    cu = check_cu_seqlens(cu_seqlens, total=rewards.shape[0])
    _check_same_length(cu, rewards=rewards, values=values)
    _check_per_seq(cu, seq_no_eos_mask=seq_no_eos_mask)
    if not (0 <= discount <= 1 and 0 <= gae_lambda <= 1):
        raise AlgoInputError(f"discount ({discount}) and gae_lambda ({gae_lambda}) must be in [0, 1]")
    first = first_token_mask(cu)
    if values is None:
        values = torch.zeros_like(rewards)
    values = values.to(rewards.dtype)

    next_values = values.clone()
    last = cu[1:] - 1
    next_values[last] = torch.where(seq_no_eos_mask.bool(), values[last], 0.0)
    prev_values = torch.where(first, 0.0, torch.roll(values, 1))
    deltas = torch.where(first, 0.0, rewards + discount * next_values - prev_values)
    advantages = _discounted_reverse_cumsum(deltas, cu, discount * gae_lambda)
    advantages = torch.where(first, 0.0, advantages)
    returns = torch.where(first, 0.0, advantages + prev_values)
    return advantages, returns


def _discounted_reverse_cumsum(x: torch.Tensor, cu: torch.Tensor, c: float) -> torch.Tensor:
    """``y_t = sum_{k >= t, same sequence} c**(k-t) * x_k``, in log2(max length) vectorised steps.

    Hillis-Steele scan: after the step with shift s, y_t sums the terms t .. t+2s-1 (cut at the
    sequence end), because y_t += c**s * y_{t+s} appends the next block of s terms.
    """
    ends = cu[1:][seq_index(cu)]  # exclusive end of each token's sequence
    pos = torch.arange(x.shape[0], device=x.device)
    max_len = int((cu[1:] - cu[:-1]).max())
    y = x.clone()
    shift = 1
    while shift < max_len:
        ahead = torch.zeros_like(y)
        ahead[:-shift] = y[shift:]
        y = y + (c**shift) * torch.where(pos + shift < ends, ahead, 0.0)
        shift *= 2
    return y


def _normalize_with(x: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, eps: float):
    return torch.where(mask, (x.double() - mean) / (std + eps), 0.0).to(x.dtype)


def masked_normalize(
    x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-5, reduce_fn: Reducer | None = None
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and (population) std over the tokens where ``mask`` holds.

    Pass ``reduce_fn`` (e.g. ``dist_sum(dp_group)``) to take the statistics over all data-parallel ranks:
    it receives the float64 vector [sum, sum of squares, count] and must return its global sum.
    Masked-out positions are 0 in the result.
    """
    if x.shape != mask.shape:
        raise AlgoInputError(
            f"x and mask must have the same shape, got {tuple(x.shape)} and {tuple(mask.shape)}"
        )
    mask = mask.bool()
    xm = torch.where(mask, x.double(), 0.0)
    moments = torch.stack([xm.sum(), xm.square().sum(), mask.sum().double()])
    if reduce_fn is not None:
        moments = reduce_fn(moments)
    total, total_sq, count = moments.unbind()
    count = count.clamp(min=1)  # an all-masked batch normalises to zeros rather than NaN
    mean = total / count
    std = (total_sq / count - mean.square()).clamp(min=0).sqrt()
    return _normalize_with(x, mask, mean, std, eps)


def group_ids_of(n_seqs: int, group_size: int) -> torch.Tensor:
    """Group id of each of ``n_seqs`` sequences when groups are ``group_size`` consecutive sequences."""
    if group_size < 1 or n_seqs % group_size != 0:
        raise AlgoInputError(
            f"group_size={group_size} must be positive and divide the number of sequences ({n_seqs})"
        )
    return torch.arange(n_seqs) // group_size


def group_masked_normalize(
    x: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    level: str = "answer",
    eps: float = 1e-5,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` within each prompt's group of answers (GRPO).

    ``level`` answer: every answer weighs the same in its group's mean and (population) std, its valid tokens
    sharing its weight, so answers whose tokens share one value (an outcome reward) get GRPO's
    ``(R_i - mean(R)) / std(R)``; token: every valid token weighs the same (the original's, which lets a long
    answer move the group's statistics more than a short one). Groups are given either as ``group_size``
    consecutive sequences or as ``group_ids`` (B integers). A group's sequences must all be in ``x`` (no
    cross-rank reduction). Masked-out positions are 0.
    """
    cu = check_cu_seqlens(cu_seqlens, total=x.shape[0])
    _check_same_length(cu, mask=mask)
    n_seqs = len(cu) - 1
    if (group_size is None) == (group_ids is None):
        raise AlgoInputError(f"give exactly one of group_size ({group_size}) and group_ids ({group_ids})")
    if group_ids is None:
        group_ids = group_ids_of(n_seqs, group_size)
    _check_per_seq(cu, group_ids=group_ids)
    _, group_of_seq = torch.unique(group_ids.to(cu.device), return_inverse=True)
    group = group_of_seq[seq_index(cu)]

    if level not in GROUP_NORM_LEVELS:
        raise AlgoInputError(
            f"unknown group normalisation level {level!r} (valid: {', '.join(GROUP_NORM_LEVELS)})"
        )
    mask = mask.bool()
    weight = mask.double()
    if level == "answer":  # 1 / |y| on each valid token: an answer's tokens weigh 1 together
        weight = weight / answer_lengths(mask, cu).double().clamp(min=1)[seq_index(cu)]
    xm = torch.where(mask, x.double(), 0.0)
    n_groups = int(group.max()) + 1

    def group_sum(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, group, v)

    count = group_sum(weight).clamp(min=1)  # tokens, or answers with a valid token: whole numbers either way
    mean = group_sum(weight * xm) / count
    std = (group_sum(weight * xm.square()) / count - mean.square()).clamp(min=0).sqrt()
    return _normalize_with(x, mask, mean[group], std[group], eps)


def _group_of_seq(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index (0..G-1) of each sequence, and G."""
    _, group = torch.unique(group_ids, return_inverse=True)
    return group, int(group.max()) + 1 if len(group) else 0


def group_baseline(scores: torch.Tensor, group_ids: torch.Tensor, kind: str = "mean") -> torch.Tensor:
    """Each answer's score minus a baseline of its prompt's group: ``mean`` (the group's mean: Dr.GRPO,
    REINFORCE++-baseline) or ``leave_one_out`` (the mean of the others: RLOO, ``n/(n-1) (R - mean)``). An
    answer alone in its group gets 0 (no baseline to learn from). ``none`` returns the scores."""
    if kind == "none":
        return scores
    if kind not in ("mean", "leave_one_out"):
        raise AlgoInputError(f"unknown group baseline {kind!r} (valid: none, mean, leave_one_out)")
    if group_ids.shape != scores.shape:
        raise AlgoInputError(f"group_ids {tuple(group_ids.shape)} and scores {tuple(scores.shape)} differ")
    group, n_groups = _group_of_seq(group_ids)
    x = scores.double()
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, x)[group]
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(x))[group]
    centred = x - sums / counts
    if kind == "leave_one_out":
        centred = centred * counts / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, centred, 0.0).to(scores.dtype)


def overlong_penalty(
    answer_lens: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong penalty of each answer: 0 up to ``max_len - buffer`` tokens, then falling linearly
    to ``-factor`` at ``max_len``, and ``-factor`` beyond."""
    if not 0 < buffer <= max_len:
        raise AlgoInputError(f"overlong buffer must be in [1, max_len={max_len}], got {buffer}")
    excess = (answer_lens.double() - (max_len - buffer)) / buffer
    return -factor * excess.clamp(0.0, 1.0)


def answer_lengths(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Tokens of each sequence the policy sampled (its loss-mask tokens)."""
    n = len(cu_seqlens) - 1
    return torch.zeros(n, dtype=torch.int64).index_add_(0, seq_index(cu_seqlens), loss_mask.long())


class Overlong(NamedTuple):
    """DAPO's soft overlong penalty: answers reaching into the last ``buffer`` of ``max_len`` tokens."""

    max_len: int
    buffer: int
    factor: float = 1.0


def compute_advantages(
    *,
    scores: torch.Tensor,
    prompt_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_no_eos_mask: torch.Tensor,
    logp_behav: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl_ctl: float = 0.1,
    kl_estimator: str = "k1",
    discount: float = 1.0,
    gae_lambda: float = 1.0,
    max_reward_clip: float = 20.0,
    mask_no_eos_with_zero: bool = False,
    baseline: str = "none",
    adv_norm: bool = True,
    group_adv_norm: bool = False,
    group_norm_level: str = "answer",
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    overlong: Overlong | None = None,
    overlong_filter: bool = False,
    logp_teacher: torch.Tensor | None = None,
    distill_coef: float = 0.0,
    distill_alone: bool = False,
    reduce_fn: Reducer | None = None,
) -> dict[str, torch.Tensor]:
    """The whole pre-update pipeline: loss mask, reward shaping, rewards, GAE and (group) normalisation.

    Defaults follow the ``ppo.*`` options. The scores get the ``overlong`` penalty, then lose the group
    ``baseline`` (needs ``group_ids`` or ``group_size``). With ``adv_norm``, ``group_adv_norm`` selects
    per-group normalisation instead of the batch-wide one, which uses ``reduce_fn`` across ranks;
    ``group_norm_level`` weighs answers or tokens alike in a group's statistics (``group_masked_normalize``).
    ``overlong_filter`` then leaves truncated answers out of the loss mask. With ``distill_coef``, each token
    gains the advantage ``distill_coef * (logp_teacher - logp_behav)`` (alone with ``distill_alone``).
    Returns ``loss_mask``, ``rewards``, ``kl_rewards``, ``advantages`` and ``returns`` (advantages and
    returns are 0 outside the loss mask).
    """
    cu = check_cu_seqlens(cu_seqlens, total=prompt_mask.shape[0])
    loss_mask = response_mask(prompt_mask, cu)
    if group_ids is None and group_size is not None:
        group_ids = group_ids_of(len(cu) - 1, group_size)
    if overlong is not None:
        lengths = answer_lengths(loss_mask, cu)
        scores = scores + overlong_penalty(lengths, *overlong).to(scores.dtype)
    if baseline != "none":
        if group_ids is None:
            raise AlgoInputError(f"group baseline {baseline!r} needs group_ids or group_size")
        scores = group_baseline(scores, group_ids, baseline)
    rewards, kl_rewards = token_rewards(
        scores,
        loss_mask,
        cu,
        seq_no_eos_mask,
        logp_behav=logp_behav,
        logp_ref=logp_ref,
        kl_ctl=kl_ctl,
        kl_estimator=kl_estimator,
        max_reward_clip=max_reward_clip,
        mask_no_eos_with_zero=mask_no_eos_with_zero,
    )
    advantages, returns = gae(rewards, values, cu, seq_no_eos_mask, discount=discount, gae_lambda=gae_lambda)
    if adv_norm and group_adv_norm:
        advantages = group_masked_normalize(
            advantages, loss_mask, cu, group_ids=group_ids, level=group_norm_level
        )
    elif adv_norm:
        advantages = masked_normalize(advantages, loss_mask, reduce_fn=reduce_fn)
    if distill_coef:
        if logp_teacher is None or logp_behav is None:
            raise AlgoInputError(f"distill_coef={distill_coef} needs logp_teacher and logp_behav")
        distill = (distill_coef * (logp_teacher - logp_behav)).to(advantages.dtype)
        advantages = distill if distill_alone else advantages + distill
    if overlong_filter:
        loss_mask = loss_mask & ~seq_no_eos_mask.bool()[seq_index(cu)]
    return {
        "loss_mask": loss_mask,
        "rewards": rewards,
        "kl_rewards": kl_rewards,
        "advantages": torch.where(loss_mask, advantages, 0.0),
        "returns": torch.where(loss_mask, returns, 0.0),
    }
