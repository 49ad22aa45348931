"""The policy losses (PPO, GSPO, CISPO; decoupled for stale data) and the critic loss, and their statistics.

Inputs are token-aligned packed tensors of one micro-batch (see ``areal_hpc.algo.packing``); only
positions where ``loss_mask`` holds contribute. The policy loss aggregates its token losses with the
minibatch's totals (``algo.aggregation``); the critic's sum is divided by ``loss_normalizer``: pass the
number of valid tokens of the whole minibatch (over all its micro-batches, and over all data-parallel
ranks if gradients are summed across ranks) and the micro-batch losses add up to the minibatch mean.
Without it a call averages over its own tokens.

Statistics use the original's names (REFERENCE section 5). A statistic is either a scalar or a
``(values, mask)`` pair of per-token tensors; ``summarize`` turns them into ``name/avg|min|max``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from areal_hpc.algo.aggregation import Totals, aggregate
from areal_hpc.algo.corrections import Correction, behaviour_weight, kl_estimate, per_sequence_mean
from areal_hpc.algo.packing import AlgoInputError

POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")
MaskedStat = tuple[torch.Tensor, torch.Tensor]
Stats = dict[str, MaskedStat | torch.Tensor | float]


def _check_shapes(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise AlgoInputError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like loss_mask"
            )
    return mask.bool()


def _normalizer(mask: torch.Tensor, loss_normalizer: float | torch.Tensor | None) -> torch.Tensor | float:
    if loss_normalizer is None:
        return mask.sum().clamp(min=1)
    if float(loss_normalizer) <= 0:
        raise AlgoInputError(f"loss_normalizer must be positive, got {loss_normalizer}")
    return loss_normalizer


def _log_ratio(
    kind: str, logprobs: torch.Tensor, base: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """The log of the ratio the policy loss ``kind`` clips: the token's, or (gspo) its answer's geometric mean."""
    # Masked positions get log-ratio 0 so padding garbage cannot overflow exp().
    log_ratio = torch.where(mask, logprobs - base, 0.0)
    if kind in ("gspo", "gspo_token"):  # the answer's geometric mean ratio s, on each of its tokens
        log_s = per_sequence_mean(log_ratio, mask, cu_seqlens)
        if kind == "gspo_token":  # s's value, each token's own gradient: sg(s) * pi / sg(pi)
            log_s = log_s.detach() + logprobs - logprobs.detach()
        log_ratio = torch.where(mask, log_s, 0.0)
    return log_ratio


def _surrogate(
    kind: str,
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_loss, clipped_low, clipped_high)`` of the policy loss ``kind`` (before dual clip)."""
    ratio = torch.exp(log_ratio)
    low, high = 1 - eps_low, 1 + eps_high
    if kind == "cispo":  # REINFORCE on log pi, weighted by the clipped ratio without its gradient
        ratio = ratio.detach()
        token_loss = -adv * ratio.clamp(low, high) * logprobs
        return token_loss, (ratio < low) & mask, (ratio > high) & mask
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(low, high)
    clipped = (loss_clipped > loss_unclipped).detach() & mask
    return torch.maximum(loss_unclipped, loss_clipped), clipped & (ratio < 1), clipped & (ratio > 1)


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    policy_loss: str = "ppo",
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    correction: Correction | None = None,
    loss_agg_mode: str = "token-mean",
    totals: Totals | None = None,
    norm_len: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
) -> tuple[torch.Tensor, Stats]:
    """The policy loss ``policy_loss`` of one micro-batch; returns ``(loss, stats)``. Only ``logprobs`` carries
    gradient. ``cu_seqlens`` (None: one sequence) delimits the answers of sequence-level quantities.

    ``r = pi / base`` with base = ``proximal_logprobs`` (decoupled loss) or ``old_logprobs`` (the behaviour
    policy mu). Per token:

    - ppo: ``max(-A*r, -A*clip(r, 1-eps_clip, 1+eps_clip_higher))``; ``c_clip`` (> 1) further caps tokens with
      A < 0 at ``-A*c_clip`` (dual clip). gspo: the same with r the answer's geometric mean ratio s (its
      gradient spread over the answer); gspo_token: ``sg(s) * pi/sg(pi)``. cispo: ``-sg(clip(r)) * A * log pi``.
    - The behaviour weight w = pi_prox/mu multiplies each token (decoupled), corrected by ``correction``.
      Without a proximal policy r = pi/mu already is the behaviour weight: the correction compares the current
      policy (detached) with mu, and the loss clips ``r * w/raw`` in place of r (clamp: the corrected weight,
      its gradient that of log pi; cispo's weight is then clip(w)). A masked token's loss is 0 and stays in
      the normaliser. All of it in log space: log-ratios of +-200 give no inf or NaN where a bound holds them.
    - ``kl_coef * k(pi, ref)`` (``kl_estimator``) is added with ``ref_logprobs`` (the KL penalty in the loss).

    Token losses are aggregated by ``loss_agg_mode`` with the minibatch's ``totals`` (None: this call is the
    minibatch). ``ppo.early_stop_imp_ratio`` judges the whole minibatch (``train.interfaces.EarlyStop``).
    """
    mask = _check_shapes(
        loss_mask,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref_logprobs,
    )
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, mask.shape[0]], device=mask.device)
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if policy_loss not in POLICY_LOSSES:
        raise AlgoInputError(f"unknown policy_loss {policy_loss!r} (valid: {', '.join(POLICY_LOSSES)})")
    if not 0 < eps_clip <= 1 or eps_high <= 0:
        raise AlgoInputError(
            f"eps_clip must be in (0, 1] and eps_clip_higher positive, got {eps_clip}, {eps_high}"
        )
    if c_clip is not None and (c_clip <= 1 or policy_loss == "cispo"):
        raise AlgoInputError(
            f"c_clip (dual clip) must be > 1 and is not of cispo, got {c_clip} with {policy_loss}"
        )
    if kl_coef and ref_logprobs is None:
        raise AlgoInputError(f"kl_coef={kl_coef} (the KL penalty in the loss) needs ref_logprobs")
    if policy_loss == "cispo" and proximal_logprobs is None and _masks(correction):
        raise AlgoInputError(
            "cispo keeps every token's gradient: a correction that masks its own ratio pi/mu (two policies) "
            "contradicts it; give action clamp (truncated importance sampling), or no bounds"
        )
    adv = advantages.detach()
    base = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    log_ratio = _log_ratio(policy_loss, logprobs, base, mask, cu_seqlens)
    raw_ratio = torch.exp(log_ratio.detach())
    judged = None
    if proximal_logprobs is not None or correction is not None:
        target = logprobs if proximal_logprobs is None else proximal_logprobs
        judged = behaviour_weight(
            target, old_logprobs, mask, cu_seqlens, correction or Correction(upper=None)
        )
    if judged is not None and proximal_logprobs is None:
        # Two policies: r = pi/mu already is the behaviour weight; the loss clips r * w/raw instead (the
        # weight the correction gives in place of the raw one), in log space so no ratio under- or overflows.
        shift = judged.log_weight - judged.log_raw
        log_ratio = torch.where(judged.kept, log_ratio + shift, 0.0)
    token_loss, clip_low, clip_high = _surrogate(
        policy_loss, log_ratio, logprobs, adv, mask, eps_clip, eps_high
    )
    clip_mask = clip_low | clip_high
    dual_clip_mask = torch.zeros_like(mask)
    if c_clip is not None:
        dual_cap = -adv * c_clip
        dual_clip_mask = (adv < 0) & (token_loss.detach() > dual_cap) & mask
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, dual_cap), token_loss)

    stats: Stats = {}
    if judged is not None:
        weight, kept = judged.weight, judged.kept
        if proximal_logprobs is not None:  # three policies: the weight pi_prox/mu multiplies the loss
            token_loss = token_loss * weight
        token_loss = torch.where(kept, token_loss, 0.0)  # (two: the weight is in the ratio)
        behave_log_ratio = torch.where(mask, target - old_logprobs, 0.0).detach()
        stats["behave_imp_weight"] = (weight, kept)
        stats["behave_approx_kl"] = (behave_log_ratio, kept)
        stats["unclipped_behave_tokens"] = kept.sum()
        if correction is not None and correction.action == "mask":
            stats["behave_masked_ratio"] = ((mask & ~kept).float(), mask)
        elif correction is not None:
            stats["behave_clamped_ratio"] = ((judged.log_weight != judged.log_raw).float(), mask)

    stats["actor_loss"] = (token_loss.detach(), mask)
    if kl_coef:
        kl = kl_estimate(logprobs, ref_logprobs.detach(), kl_estimator)
        token_loss = token_loss + kl_coef * kl
        stats["kl_loss"] = (kl.detach(), mask)
    loss = aggregate(token_loss, mask, cu_seqlens, loss_agg_mode, totals, norm_len)

    stats.update(
        n_tokens=torch.tensor(mask.numel()),
        n_valid_tokens=mask.sum(),
        clipped_tokens=clip_mask.sum(),
        dual_clipped_tokens=dual_clip_mask.sum(),
        importance_weight=(raw_ratio, mask),
        approx_kl=(-torch.where(mask, logprobs - base, 0.0).detach(), mask),
        clip_ratio=(clip_mask.float(), mask),
        clip_ratio_low=(clip_low.float(), mask),
        clip_ratio_high=(clip_high.float(), mask),
        dual_clip_ratio=(dual_clip_mask.float(), mask),
        advantages=(adv, mask),
        new_logp=(logprobs.detach(), mask),
        old_logp=(old_logprobs.detach(), mask),
    )
    return loss, stats


def _masks(correction: Correction | None) -> bool:
    """Whether ``correction`` can give a token weight 0."""
    if correction is None or correction.action != "mask":
        return False
    return correction.lower is not None or correction.upper is not None


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    value_eps_clip: float = 0.2,
    loss_normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped value loss ``0.5 * max((v-R)^2, (clip(v, v_old-eps, v_old+eps)-R)^2)``; ``(loss, stats)``.

    Only ``values`` carries gradient; normalisation as in ``actor_loss``.
    """
    mask = _check_shapes(loss_mask, values=values, old_values=old_values, returns=returns)
    if value_eps_clip <= 0:
        raise AlgoInputError(f"value_eps_clip must be positive, got {value_eps_clip}")
    old, ret = old_values.detach(), returns.detach()
    clipped = old + (values - old).clamp(-value_eps_clip, value_eps_clip)
    loss_unclipped = (values - ret).square()
    loss_clipped = (clipped - ret).square()
    token_loss = torch.where(mask, 0.5 * torch.maximum(loss_unclipped, loss_clipped), 0.0)
    clip_mask = (loss_clipped > loss_unclipped).detach() & mask
    loss = token_loss.sum() / _normalizer(mask, loss_normalizer)
    stats: Stats = {
        "n_tokens": torch.tensor(mask.numel()),
        "n_valid_tokens": mask.sum(),
        "value_loss": (token_loss.detach(), mask),
        "value_clip_ratio": (clip_mask.float(), mask),
        "values": (values.detach(), mask),
        "old_values": (old, mask),
        "returns": (ret, mask),
    }
    return loss, stats


def masked_summary(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``{name}/avg``, ``/min`` and ``/max`` of ``values`` where ``mask`` holds (empty dict if none do)."""
    selected = values.detach()[mask.bool()].double()
    if selected.numel() == 0:
        return {}
    return {
        f"{name}/avg": selected.mean().item(),
        f"{name}/min": selected.min().item(),
        f"{name}/max": selected.max().item(),
    }


def summarize(stats: Mapping[str, MaskedStat | torch.Tensor | float], scope: str = "") -> dict[str, float]:
    """Flatten a stats dict to floats: pairs become ``{scope}/{name}/avg|min|max``, scalars stay as is."""
    prefix = f"{scope}/" if scope else ""
    out: dict[str, float] = {}
    for name, stat in stats.items():
        if isinstance(stat, tuple):
            out.update(masked_summary(prefix + name, *stat))
        else:
            out[prefix + name] = float(stat)
    return out
