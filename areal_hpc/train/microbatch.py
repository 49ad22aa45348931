"""How a rank cuts its packed batch for the model: minibatches, micro-batches, and padded model inputs.

A batch is a dict of numpy arrays in the packed layout of ``areal_hpc.data.batch`` (``cu_seqlens`` plus
per-token and per-sequence arrays). Minibatches (one optimizer step each) and micro-batches (one forward and
backward each) are sub-batches repacked by ``data.batch.select``. A micro-batch reaches the model as a
right-padded ``[n, max_len]`` batch with an attention mask; ``unpad`` turns outputs back into the packed order.
A per-token array may have rows of its own shape (routing replay's ``packed_routed_experts``, [T, layers, top_k]):
``select`` moves whole rows, so each token keeps its own in every minibatch and micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from areal_hpc.algo import balanced_partition, ffd_pack, seq_index, split_minibatches
from areal_hpc.config import MicroBatchSpec
from areal_hpc.data import CU, select

# A micro-batch of one token, run (with zero loss) by a rank that has fewer micro-batches than its peers or none,
# so that every rank makes the same collective calls.
EMPTY_MB = {CU: np.array([0, 1], dtype=np.int64), "packed_input_ids": np.zeros(1, dtype=np.int64)}

Batch = Mapping[str, np.ndarray]


def empty_micro_batch(batch: Batch) -> dict[str, np.ndarray]:
    """EMPTY_MB with a zero row for each per-token array of ``batch`` whose rows have a shape of their own (the
    routed experts of routing replay): the model gets from it every input that the batch's micro-batches bring."""
    n_tokens = int(np.asarray(batch[CU])[-1])
    rows = {
        key: np.zeros((1, *value.shape[1:]), dtype=value.dtype)
        for key, value in batch.items()
        if key != CU and value.ndim > 1 and value.shape[0] == n_tokens
    }
    return {**EMPTY_MB, **rows}


def seq_lengths(batch: Batch) -> list[int]:
    """Token count of each sequence of a packed batch."""
    return np.diff(np.asarray(batch[CU], dtype=np.int64)).tolist()


def token_indices(cu_seqlens: np.ndarray, seqs: list[int]) -> np.ndarray:
    """Positions in the packed arrays of the tokens of sequences ``seqs`` (in that order)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if not seqs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs])


def in_packed_order(cu_seqlens: np.ndarray, parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """Per-token values of micro-batches (the sequences of each and its values, on any device) in the batch's
    packed order, float32 on the CPU: one copy to the host for them all, not a wait per micro-batch."""
    out = torch.zeros(int(cu_seqlens[-1]), dtype=torch.float32)
    if parts:
        index = np.concatenate([token_indices(cu_seqlens, seqs) for seqs, _ in parts])
        out[torch.from_numpy(index)] = torch.cat([values.float() for _, values in parts]).cpu()
    return out


def micro_batch_groups(lengths: list[int], mb_spec: MicroBatchSpec) -> list[list[int]]:
    """Sequence indices of each micro-batch: first-fit-decreasing under ``max_tokens_per_mb``, then at least
    ``n_mbs`` groups (or one per sequence when there are fewer) by halving the heaviest group.

    Halving never adds tokens to a group, so every group with more than one sequence stays within the budget.
    """
    if not lengths:
        return []
    groups = ffd_pack(lengths, mb_spec.max_tokens_per_mb)
    target = min(mb_spec.n_mbs, len(lengths))
    while len(groups) < target:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        heaviest = max(splittable, key=lambda g: sum(lengths[i] for i in groups[g]))
        group = groups[heaviest]
        halves = balanced_partition([lengths[i] for i in group], 2)
        groups[heaviest : heaviest + 1] = [[group[k] for k in half] for half in halves]
    return groups


def micro_batches(batch: Batch, mb_spec: MicroBatchSpec) -> list[dict[str, np.ndarray]]:
    """The micro-batches of ``batch`` (each a repacked sub-batch); none for an empty batch."""
    return [select(batch, group) for group in micro_batch_groups(seq_lengths(batch), mb_spec)]


def minibatches(batch: Batch, n_minibatches: int) -> list[dict[str, np.ndarray] | None]:
    """``n_minibatches`` contiguous parts of balanced token count; ``None`` for parts this rank has no
    sequence for (it still takes part in that optimizer step, with zero gradient)."""
    lengths = seq_lengths(batch)
    parts = split_minibatches(lengths, min(n_minibatches, len(lengths)))
    return [select(batch, p) for p in parts] + [None] * (n_minibatches - len(parts))


def to_torch(batch: Batch, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The arrays of ``batch`` as torch tensors on ``device``."""
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}


def pad(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids (T) -> right-padded ids ``[n, max_len]`` and the bool mask of real tokens."""
    seq = seq_index(cu_seqlens)
    pos = torch.arange(input_ids.shape[0], device=input_ids.device) - cu_seqlens[seq]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    shape = (len(lengths), int(lengths.max()))
    ids = torch.full(shape, pad_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros(shape, dtype=torch.bool, device=input_ids.device)
    ids[seq, pos] = input_ids
    mask[seq, pos] = True
    return ids, mask


def unpad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Padded outputs ``[n, max_len, ...]`` -> packed ``[T, ...]`` (right padding keeps the packed order)."""
    return x[mask]
