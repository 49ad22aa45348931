"""The packed-sequence layout and how sequences are grouped into batches.

Layout used by all of ``areal_hpc.algo``: a batch of B sequences is concatenated into 1-D tensors of
total length T, and ``cu_seqlens`` (B+1 integers, starting at 0, ending at T) gives the boundaries:
sequence ``b`` is ``x[cu_seqlens[b]:cu_seqlens[b+1]]``.

Per-token quantities are *token-aligned* and have length T: ``logprobs[t]`` is log p(token t | tokens < t).
The first token of every sequence has no logprob; its slot holds 0 and is never part of a loss mask
(it is a prompt token anyway). We keep length T rather than the original's T-B "short1" layout so that
every per-token tensor, ``prompt_mask`` and ``cu_seqlens`` index the same positions and nothing needs
shifting. A model's output at position t predicts token t+1; ``align_next_token`` converts it.

Grouping (index lists over the B sequences, all deterministic):
- ``split_minibatches``: contiguous parts of balanced token count, one optimizer step each;
- ``ffd_pack``: micro-batches under a token budget by first-fit-decreasing;
- ``balanced_partition``: k parts of balanced token count, for data-parallel dispatch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch


class AlgoInputError(ValueError):
    """Input to an ``areal_hpc.algo`` function has the wrong shape, type or value."""


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Validate ``cu_seqlens`` (and that it ends at ``total`` if given); return it as int64."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise AlgoInputError(f"cu_seqlens must be a 1-D tensor with at least 2 entries, got {cu_seqlens!r}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise AlgoInputError(f"cu_seqlens must be int32 or int64, got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.long()
    if cu[0].item() != 0 or bool((cu[1:] <= cu[:-1]).any()):
        raise AlgoInputError(f"cu_seqlens must start at 0 and strictly increase, got {cu.tolist()}")
    if total is not None and cu[-1].item() != total:
        raise AlgoInputError(f"cu_seqlens ends at {cu[-1].item()} but the packed tensors have length {total}")
    return cu


def seq_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """For every token, the index of the sequence it belongs to (int64, length T)."""
    cu = check_cu_seqlens(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)


def first_token_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool mask (length T), true at the first token of each sequence (the slot without a logprob)."""
    cu = check_cu_seqlens(cu_seqlens)
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool, device=cu.device)
    mask[cu[:-1]] = True
    return mask


def align_next_token(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Turn next-token values (position t is about token t+1) into token-aligned values (length T).

    The last position of each sequence predicts nothing and is dropped; each first slot becomes 0.
    """
    cu = check_cu_seqlens(cu_seqlens, total=x.shape[0])
    # Rolling by one moves each sequence's dropped last value onto the next sequence's first slot.
    out = torch.roll(x, shifts=1, dims=0)
    out[cu[:-1]] = 0
    return out


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    lengths = [int(n) for n in lengths]
    if any(n <= 0 for n in lengths):
        raise AlgoInputError(f"sequence lengths must be positive, got {lengths}")
    return lengths


def _check_parts(n_parts: int, n_seqs: int, what: str) -> None:
    if n_parts < 1 or n_parts > n_seqs:
        raise AlgoInputError(f"{what}={n_parts} must be between 1 and the number of sequences ({n_seqs})")


def split_minibatches(lengths: Sequence[int], n_minibatches: int) -> list[list[int]]:
    """Split sequences into ``n_minibatches`` contiguous, non-empty parts of balanced token count.

    Each part is one PPO optimizer step (``ppo.ppo_n_minibatches``). Parts keep the batch order, so
    the oldest samples train first and a group of GRPO answers mostly stays together; advantages are
    computed on the whole batch before the split, so the split does not change them.
    """
    lengths = _check_lengths(lengths)
    _check_parts(n_minibatches, len(lengths), "n_minibatches")
    cum = np.cumsum(lengths)
    cuts = [0]
    for i in range(1, n_minibatches):
        target = cum[-1] * i / n_minibatches
        # Cut after the sequence whose running total is closest to the target, leaving at least one
        # sequence for this part and for each part still to come.
        lo, hi = cuts[-1] + 1, len(lengths) - (n_minibatches - i)
        cut = lo + int(np.argmin(np.abs(cum[lo - 1 : hi] - target)))
        cuts.append(cut)
    cuts.append(len(lengths))
    return [list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def ffd_pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack sequences into micro-batches of at most ``max_tokens`` tokens by first-fit-decreasing.

    Sequences are placed longest first (ties: lower index first) into the first bin with room. A
    sequence longer than the budget gets a bin of its own. Bins are returned in creation order, each
    with ascending sequence indices.
    """
    lengths = _check_lengths(lengths)
    if max_tokens < 1:
        raise AlgoInputError(f"max_tokens must be positive, got {max_tokens}")
    room = np.zeros(len(lengths), dtype=np.int64)  # free tokens per bin; at most one bin per sequence
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        fits = np.flatnonzero(room[: len(bins)] >= n)
        if len(fits):
            room[fits[0]] -= n
            bins[fits[0]].append(i)
        else:
            room[len(bins)] = max(max_tokens - n, 0)
            bins.append([i])
    return [sorted(b) for b in bins]


def balanced_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split sequences into ``k`` non-empty parts of balanced token count (for data-parallel dispatch).

    Longest first (ties: lower index first), each sequence goes to the part with the fewest tokens so
    far (ties: lower part index). Each part lists its sequence indices in ascending order.
    """
    lengths = _check_lengths(lengths)
    _check_parts(k, len(lengths), "k")
    heap = [(0, p) for p in range(k)]  # (tokens, part index): a min-heap picks the lightest part
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        tokens, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (tokens + lengths[i], p))
    return [sorted(p) for p in parts]
