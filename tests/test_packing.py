"""Packed layout helpers and the grouping of sequences into minibatches, micro-batches and DP parts."""

import random

import pytest
import torch

from areal_hpc.algo.packing import (
    AlgoInputError,
    align_next_token,
    balanced_partition,
    check_cu_seqlens,
    ffd_pack,
    first_token_mask,
    seq_index,
    split_minibatches,
)


def test_cu_seqlens_helpers():
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    assert check_cu_seqlens(cu, total=6).dtype == torch.int64
    assert seq_index(cu).tolist() == [0, 0, 1, 1, 1, 2]
    assert first_token_mask(cu).tolist() == [True, False, True, False, False, True]


@pytest.mark.parametrize(
    "cu, message",
    [
        (torch.tensor([1, 3]), "start at 0"),
        (torch.tensor([0, 3, 3]), "strictly increase"),
        (torch.tensor([0.0, 3.0]), "int32 or int64"),
        (torch.tensor([0]), "at least 2"),
    ],
)
def test_bad_cu_seqlens_is_rejected_with_the_value(cu, message):
    with pytest.raises(AlgoInputError, match=message):
        check_cu_seqlens(cu)


def test_cu_seqlens_must_end_at_the_packed_length():
    with pytest.raises(AlgoInputError, match="ends at 5 but the packed tensors have length 6"):
        check_cu_seqlens(torch.tensor([0, 5]), total=6)


def test_align_next_token_shifts_within_each_sequence():
    # Model outputs: position t holds the logprob of token t+1; 9s are the meaningless last positions.
    next_token = torch.tensor([-0.5, -0.25, 9.0, -2.0, 9.0])
    cu = torch.tensor([0, 3, 5])
    assert align_next_token(next_token, cu).tolist() == [0.0, -0.5, -0.25, 0.0, -2.0]


def test_split_minibatches_is_contiguous_and_balanced():
    assert split_minibatches([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert split_minibatches([10, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    # Every part keeps at least one sequence, even when one sequence holds most tokens.
    assert split_minibatches([1, 1, 100], 3) == [[0], [1], [2]]
    assert split_minibatches([5, 5, 5], 1) == [[0, 1, 2]]


def test_split_minibatches_covers_everything_in_order():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, len(lengths))
        parts = split_minibatches(lengths, k)
        assert len(parts) == k and all(parts)
        assert [i for p in parts for i in p] == list(range(len(lengths)))


def test_split_minibatches_rejects_more_parts_than_sequences():
    with pytest.raises(AlgoInputError, match="n_minibatches=3"):
        split_minibatches([1, 2], 3)


def test_ffd_pack_hand_case():
    # Longest first: 6 opens bin A (room 2), 5 opens B (room 3), 4 opens C (room 4),
    # 3 goes to B (first with room), 2 goes to A.
    assert ffd_pack([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]


def test_ffd_pack_gives_an_oversized_sequence_its_own_bin():
    assert ffd_pack([10, 3, 3], 8) == [[0], [1, 2]]
    assert ffd_pack([3, 12, 11], 8) == [[1], [2], [0]]


def test_ffd_pack_invariants_on_random_lengths():
    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(20, 150)
        bins = ffd_pack(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in b) for b in bins]
        for b, load in zip(bins, loads, strict=True):
            assert load <= budget or len(b) == 1
            assert b == sorted(b)
        # First fit never leaves two bins at most half full.
        assert sum(load * 2 <= budget for load in loads) <= 1
        assert ffd_pack(lengths, budget) == bins


def test_balanced_partition_hand_case():
    # 8 -> part0, 7 -> part1, 6 -> part1 (7 < 8), 5 -> part0 (8 < 13), 4 -> part0 (tie 13/13, lower index).
    assert balanced_partition([8, 7, 6, 5, 4], 2) == [[0, 3, 4], [1, 2]]


def test_balanced_partition_invariants_on_random_lengths():
    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 50))]
        k = rng.randint(1, len(lengths))
        parts = balanced_partition(lengths, k)
        assert len(parts) == k and all(parts)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(lengths)


def test_grouping_rejects_bad_lengths():
    with pytest.raises(AlgoInputError, match=r"positive, got \[3, 0\]"):
        ffd_pack([3, 0], 8)
    with pytest.raises(AlgoInputError, match="max_tokens"):
        ffd_pack([3], 0)
    with pytest.raises(AlgoInputError, match="k=0"):
        balanced_partition([3], 0)
