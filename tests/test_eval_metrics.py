"""The evaluation metrics on hand-computed cases; unbiased pass@k against counting the k-subsets."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.eval.metrics import Question, dataset_metrics, majority_correct, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 0, 3, 0.0),
        (4, 4, 1, 1.0),
        (5, 3, 3, 1.0),  # only 2 wrong: any 3 samples hold a correct one
        (32, 8, 8, 1 - 735471 / 10518300),  # 1 - C(24,8)/C(32,8)
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(nck):
    n, c, k = nck
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_the_majority_answer_decides_and_the_earliest_wins_a_tie():
    assert majority_correct(["3", "5", "5", None], [True, False, False, False]) is False
    assert majority_correct(["3", "5", "3 ", "5"], [True, False, True, False]) is True  # tie: "3" came first
    assert majority_correct([None, None], [False, False]) is False


def test_dataset_metrics_by_hand():
    questions = [
        Question(True, 10, [True, False, False, True], [20, 30, 40, 50], ["1", "2", "2", "1"]),
        Question(False, 30, [False, False, False, False], [10, 10, 10, 10], ["7", None, "8", "8"]),
    ]
    metrics = dataset_metrics(questions, ks=(1, 2, 4, 8))
    assert metrics == {
        "num_questions": 2,
        "greedy_acc": 50.0,
        "greedy_length": 20.0,
        "sample_pass@1": 25.0,  # (2/4 + 0/4) / 2
        "sample_length": 22.5,
        "pass@1": 25.0,
        "maj@1": 50.0,  # the first sample alone: right, then wrong
        "pass@2": pytest.approx(100 * (1 - 1 / 6) / 2),  # 1 - C(2,2)/C(4,2) for the first question
        "maj@2": 50.0,  # "1" and "2" tie: "1" came first, right
        "pass@4": 50.0,
        "maj@4": 50.0,  # "1" twice, "2" twice: "1" first; the second question's "8" is wrong
    }
