"""PPO actor and critic losses, with the decoupled (stale-data) objective, and their statistics.

Inputs are token-aligned packed tensors of one micro-batch (see ``areal_hpc.algo.packing``); only
positions where ``loss_mask`` holds contribute. Losses are *sums* over valid tokens divided by
``loss_normalizer``: pass the number of valid tokens of the whole minibatch (over all its
micro-batches, and over all data-parallel ranks if gradients are summed across ranks) and the
micro-batch losses add up to the minibatch mean. Without it a call averages over its own tokens.

Statistics use the original's names (REFERENCE section 5). A statistic is either a scalar or a
``(values, mask)`` pair of per-token tensors; ``summarize`` turns them into ``name/avg|min|max``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from areal_hpc.algo.advantages import Reducer
from areal_hpc.algo.packing import AlgoInputError

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


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    c_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    early_stop_imp_ratio: float | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    reduce_fn: Reducer | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped PPO policy loss; returns ``(loss, stats)``. Only ``logprobs`` carries gradient.

    ``r = exp(logprobs - base)`` with base = ``proximal_logprobs`` (decoupled loss) or ``old_logprobs``
    (the behaviour policy's). Per token: ``max(-A*r, -A*clip(r, 1-eps_clip, 1+eps_clip))``; with
    ``c_clip`` (> 1) tokens with A < 0 are further capped at ``-A*c_clip`` (dual clip). Decoupled:
    each token is weighted by ``w = exp(proximal - old)``, and tokens with ``w > behav_imp_weight_cap``
    get weight 0 (they stay in the normaliser). If the mean of r over valid tokens (summed over ranks
    by ``reduce_fn``) exceeds ``early_stop_imp_ratio``, the loss is multiplied by 0; like the original,
    this is judged per call, i.e. per micro-batch.
    """
    mask = _check_shapes(
        loss_mask,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        proximal_logprobs=proximal_logprobs,
    )
    if not 0 < eps_clip < 1:
        raise AlgoInputError(f"eps_clip must be in (0, 1), got {eps_clip}")
    if c_clip is not None and c_clip <= 1:
        raise AlgoInputError(f"c_clip (dual clip) must be > 1, got {c_clip}")
    if behav_imp_weight_cap is not None and (proximal_logprobs is None or behav_imp_weight_cap <= 1):
        raise AlgoInputError(
            f"behav_imp_weight_cap={behav_imp_weight_cap} needs proximal_logprobs and must be > 1"
        )
    adv = advantages.detach()
    base = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()

    # Masked positions get log-ratio 0 so padding garbage cannot overflow exp().
    log_ratio = torch.where(mask, logprobs - base, 0.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip)
    token_loss = torch.maximum(loss_unclipped, loss_clipped)
    clip_mask = (loss_clipped > loss_unclipped).detach() & mask
    dual_clip_mask = torch.zeros_like(mask)
    if c_clip is not None:
        dual_cap = -adv * c_clip
        dual_clip_mask = (adv < 0) & (token_loss.detach() > dual_cap) & mask
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, dual_cap), token_loss)

    stats: Stats = {}
    if proximal_logprobs is not None:
        behave_log_ratio = torch.where(mask, proximal_logprobs - old_logprobs, 0.0).detach()
        behave_weight = torch.exp(behave_log_ratio)
        behave_mask = mask.clone()
        if behav_imp_weight_cap is not None:
            behave_mask &= behave_weight <= behav_imp_weight_cap
        behave_weight = torch.where(behave_mask, behave_weight, 0.0)
        token_loss = token_loss * behave_weight
        stats["behave_imp_weight"] = (behave_weight, behave_mask)
        stats["behave_approx_kl"] = (behave_log_ratio, behave_mask)
        stats["unclipped_behave_tokens"] = behave_mask.sum()

    token_loss = torch.where(mask, token_loss, 0.0)
    loss = token_loss.sum() / _normalizer(mask, loss_normalizer)

    mean_ratio = _global_mean(ratio.detach(), mask, reduce_fn)
    early_stopped = early_stop_imp_ratio is not None and bool(mean_ratio > early_stop_imp_ratio)
    if early_stopped:
        loss = loss * 0.0

    stats.update(
        n_tokens=torch.tensor(mask.numel()),
        n_valid_tokens=mask.sum(),
        clipped_tokens=clip_mask.sum(),
        dual_clipped_tokens=dual_clip_mask.sum(),
        importance_weight=(ratio.detach(), mask),
        approx_kl=(-log_ratio.detach(), mask),
        clip_ratio=(clip_mask.float(), mask),
        dual_clip_ratio=(dual_clip_mask.float(), mask),
        actor_loss=(token_loss.detach(), mask),
        advantages=(adv, mask),
        new_logp=(logprobs.detach(), mask),
        old_logp=(old_logprobs.detach(), mask),
        mean_importance_weight=mean_ratio,
        early_stopped=torch.tensor(float(early_stopped)),
    )
    return loss, stats


def _global_mean(x: torch.Tensor, mask: torch.Tensor, reduce_fn: Reducer | None) -> torch.Tensor:
    sums = torch.stack([torch.where(mask, x, 0.0).sum().double(), mask.sum().double()])
    if reduce_fn is not None:
        sums = reduce_fn(sums)
    return sums[0] / sums[1].clamp(min=1)


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
