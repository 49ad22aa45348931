"""Off-policy corrections: how far the behaviour policy mu (the servers' logprobs) is from the policy pi being
trained, and what to do about it (docs/algorithms.md).

pi is the proximal policy when logprobs are recomputed (the decoupled loss: three policies), else the current
one, detached (two policies). Per-token tensors are packed and token-aligned (``areal_hpc.algo.packing``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from areal_hpc.algo.packing import AlgoInputError, seq_index

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, logp_base: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Schulman's estimators of KL(p || base) on tokens sampled from p, with rho = base/p: k1 = -log rho,
    k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho (unbiased and never negative). k3 is computed as
    ``expm1(log rho) - log rho``: exact near rho = 1, +inf (never NaN) where rho overflows."""
    log_rho = logp_base - logp
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return log_rho.square() / 2
    if estimator == "k3":
        return torch.expm1(log_rho) - log_rho
    raise AlgoInputError(f"unknown KL estimator {estimator!r} (valid: {', '.join(KL_ESTIMATORS)})")


@dataclass(frozen=True)
class Correction:
    """``ppo.behav_correction``: the bounds of a metric of pi against mu and what happens outside them.

    level token judges each token; sequence the answer as a whole (the geometric mean of its ratios, which is
    then the weight of all its tokens, or the mean of its k1/k2/k3). action mask gives weight 0 outside the
    bounds; clamp clips the importance weight into them (metric ratio only). The KL metrics are verl's, with
    r = pi/mu on tokens sampled from mu: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (an estimate of
    KL(mu || pi)).
    """

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    lower: float | None = None
    upper: float | None = 5.0

    def __post_init__(self):
        if self.level not in ("token", "sequence") or self.action not in ("mask", "clamp"):
            raise AlgoInputError(f"correction level {self.level!r} / action {self.action!r} is not known")
        if self.metric not in ("ratio", *KL_ESTIMATORS):
            raise AlgoInputError(f"correction metric {self.metric!r} is not ratio, k1, k2 or k3")
        if self.action == "clamp" and self.metric != "ratio":
            raise AlgoInputError(
                f"action clamp clips the importance weight: metric must be ratio, not {self.metric}"
            )
        if self.lower is not None and self.upper is not None and self.lower >= self.upper:
            raise AlgoInputError(f"correction bounds: lower {self.lower} is not below upper {self.upper}")


def per_sequence_mean(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's sequence's mean of ``x`` over its masked tokens (0 for a sequence with none); differentiable."""
    seq, n_seqs = seq_index(cu_seqlens), len(cu_seqlens) - 1
    sums = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, torch.where(mask, x, 0.0))
    counts = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, mask.to(x.dtype))
    return (sums / counts.clamp(min=1))[seq]


class Judged(NamedTuple):
    """A correction's verdict on each token, in log space (a log-ratio of +-200 overflows no float32): all
    detached, 0 (log) or False outside the loss mask."""

    log_raw: torch.Tensor  # the importance weight before the correction: the token's, or its answer's
    log_weight: torch.Tensor  # after it (clamp: clipped into the bounds; mask: log_raw)
    kept: torch.Tensor  # the tokens whose weight is not 0 (mask: in bounds)

    @property
    def weight(self) -> torch.Tensor:
        """The corrected weight, 0 where not kept (exp of a masked log is never evaluated)."""
        return torch.where(self.kept, torch.exp(torch.where(self.kept, self.log_weight, 0.0)), 0.0)


def _log_bound(bound: float | None, side: float) -> float:
    return side if bound is None else (math.log(bound) if bound > 0 else -math.inf)


def behaviour_weight(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    correction: Correction,
) -> Judged:
    """The corrected importance weight pi/mu of each token (see ``Judged``).

    The raw weight is the token's ratio, or at level sequence with metric ratio its answer's geometric mean.
    """
    mask = mask.bool()
    log_ratio = torch.where(mask, logp.detach() - behav_logp.detach(), 0.0)
    answer = correction.level == "sequence" and correction.metric == "ratio"
    log_raw = torch.where(mask, per_sequence_mean(log_ratio, mask, cu_seqlens), 0.0) if answer else log_ratio
    kept, log_weight = mask.clone(), log_raw
    lower, upper = _log_bound(correction.lower, -math.inf), _log_bound(correction.upper, math.inf)
    if correction.action == "clamp":
        log_weight = log_raw.clamp(min=lower, max=upper)
    elif correction.metric == "ratio":  # compared in log space: exp() never runs out of range
        kept &= (log_raw >= lower) & (log_raw <= upper)
    else:
        metric = kl_estimate(behav_logp.detach(), logp.detach(), correction.metric)  # rho = pi/mu
        metric = torch.where(mask, metric, 0.0)
        if correction.level == "sequence":
            metric = per_sequence_mean(metric, mask, cu_seqlens)
        if correction.lower is not None:
            kept &= metric >= correction.lower
        if correction.upper is not None:
            kept &= metric <= correction.upper
    return Judged(log_raw, torch.where(kept, log_weight, 0.0), kept)


def loglinear_proximal(
    behav_logp: torch.Tensor, logp: torch.Tensor, token_versions: torch.Tensor, version: int
) -> torch.Tensor:
    """AReaL's loglinear approximation of the proximal policy (A-3PO, arXiv 2512.06547), without its forward
    pass: ``log pi_prox = log mu + a (log pi - log mu)`` with ``a = (v - v_mu) / (v + 1 - v_mu)`` in [0, 1].

    ``version`` is the proximal policy's (the weights at the start of the train step) and the current policy
    is taken one version ahead of it; a token sampled by ``version`` itself keeps its behaviour logprob (a = 0).
    Tokens without a version (negative: not sampled) get a = 0.
    """
    v_mu = token_versions.to(torch.float64)
    stale = (v_mu >= 0) & (v_mu < version)
    alpha = torch.where(stale, (version - v_mu) / (version + 1 - v_mu).clamp(min=1), 0.0)
    behav = behav_logp.detach()
    return (behav + alpha.to(behav.dtype) * (logp.detach() - behav)).detach()
