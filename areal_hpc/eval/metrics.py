"""The evaluation metrics of the original (REFERENCE.md section 8), from each question's greedy answer and
its n samples: greedy_acc, sample_pass@1, unbiased pass@k, maj@k (all in percent), greedy_length and
sample_length (mean tokens), num_questions.

- pass@k of a question with c of its n samples correct is ``1 - C(n-c, k) / C(n, k)``: the chance that k of
  the n samples drawn without replacement hold a correct one (unbiased, unlike ``1 - (1 - c/n)^k``).
- maj@k: the answer stated most often among the first k samples (the earliest among ties) is a correct
  one. Answers are grouped by their text with spaces removed; samples that state none do not vote.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """One question's outcome: its greedy answer and its samples (answers as extracted, None if none)."""

    greedy_correct: bool
    greedy_tokens: int
    sample_correct: Sequence[bool]
    sample_tokens: Sequence[int]
    sample_answers: Sequence[str | None]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with `c` of its `n` samples correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k of the samples hold a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the answer stated most often (the earliest among ties) is a correct one."""
    keys = [None if a is None else "".join(a.split()) for a in answers]
    votes = Counter(key for key in keys if key is not None)
    if not votes:
        return False
    top = max(votes.values())
    for key, ok in zip(keys, correct, strict=True):
        if key is not None and votes[key] == top:
            return ok
    raise AssertionError("unreachable: the top answer is among the answers")


def dataset_metrics(questions: Sequence[Question], ks: Sequence[int] = (1, 8, 16, 32)) -> dict[str, float]:
    """The metrics of one dataset; pass@k and maj@k for each k up to the samples per question."""
    if not questions:
        raise ValueError("no questions to score")
    n = min(len(q.sample_correct) for q in questions)
    out = {
        "num_questions": len(questions),
        "greedy_acc": 100.0 * _mean([q.greedy_correct for q in questions]),
        "greedy_length": _mean([q.greedy_tokens for q in questions]),
    }
    if n == 0:
        return out
    out["sample_pass@1"] = 100.0 * _mean([_mean(q.sample_correct[:n]) for q in questions])
    out["sample_length"] = _mean([t for q in questions for t in q.sample_tokens[:n]])
    for k in (k for k in ks if k <= n):
        out[f"pass@{k}"] = 100.0 * _mean([pass_at_k(n, sum(q.sample_correct[:n]), k) for q in questions])
        out[f"maj@{k}"] = 100.0 * _mean(
            [majority_correct(q.sample_answers[:k], q.sample_correct[:k]) for q in questions]
        )
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
