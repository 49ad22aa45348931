"""Loss aggregation (``ppo.loss_agg_mode``): the weight of each token's loss in a minibatch's loss.

A minibatch is cut into micro-batches (one backward each) and spread over data-parallel ranks whose gradients
are summed. Every mode is a weighted sum of token losses whose normaliser is of the whole minibatch
(``Totals``, summed over its micro-batches and ranks), never of one micro-batch: however the minibatch is cut,
the summed gradient is the same. A sequence is never cut, so its own length is local.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from areal_hpc.algo.packing import AlgoInputError, seq_index

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


class Totals(NamedTuple):
    """What a minibatch holds, over all its micro-batches and ranks: valid tokens, and sequences with one."""

    tokens: float
    seqs: float


def _seq_tokens(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Valid tokens of each sequence."""
    n = len(cu_seqlens) - 1
    return torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(
        0, seq_index(cu_seqlens), mask.double()
    )


def local_totals(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[valid tokens, sequences with a valid token] of one part (float64), to be summed into ``Totals``."""
    mask = mask.bool()
    return torch.stack([mask.sum().double(), (_seq_tokens(mask, cu_seqlens) > 0).sum().double()])


def token_weights(
    mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, totals: Totals, norm_len: float | None = None
) -> torch.Tensor:
    """Each token's weight (float64, 0 outside ``mask``) so that ``sum(weights * token_loss)`` over the whole
    minibatch is its loss under ``mode``. ``norm_len`` is seq-mean-token-sum-norm's constant (Dr.GRPO's)."""
    if mode not in AGG_MODES:
        raise AlgoInputError(f"unknown loss_agg_mode {mode!r} (valid: {', '.join(AGG_MODES)})")
    if mode == "seq-mean-token-sum-norm" and not (norm_len and norm_len > 0):
        raise AlgoInputError(f"loss_agg_mode {mode} needs a positive norm_len, got {norm_len}")
    mask = mask.bool()
    tokens, seqs = max(float(totals.tokens), 1.0), max(float(totals.seqs), 1.0)
    if mode == "token-mean":
        w = torch.full(mask.shape, 1 / tokens, dtype=torch.float64, device=mask.device)
    elif mode == "token-sum":
        w = torch.ones(mask.shape, dtype=torch.float64, device=mask.device)
    elif mode == "seq-mean-token-mean":
        w = 1 / (_seq_tokens(mask, cu_seqlens).clamp(min=1)[seq_index(cu_seqlens)] * seqs)
    elif mode == "seq-mean-token-sum":
        w = torch.full(mask.shape, 1 / seqs, dtype=torch.float64, device=mask.device)
    else:
        w = torch.full(mask.shape, 1 / (norm_len * seqs), dtype=torch.float64, device=mask.device)
    return torch.where(mask, w, 0.0)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str = "token-mean",
    totals: Totals | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """This part's share of the minibatch loss under ``mode``; ``totals`` None: the part is the minibatch."""
    mask = mask.bool()
    if totals is None:
        totals = Totals(*local_totals(mask, cu_seqlens).tolist())
    token_loss = torch.where(mask, token_loss, 0.0)
    if mode == "token-mean":  # as a division, so that the default's numbers stay bit for bit what they were
        return token_loss.sum() / max(float(totals.tokens), 1.0)
    weights = token_weights(mask, cu_seqlens, mode, totals, norm_len)
    return (token_loss * weights.to(token_loss.dtype)).sum()
