"""The math verifier pool: rewards of responses, per-check timeouts, the math_500 acceptance tests."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from areal_hpc.algo.math_parse import AnswerInputError
from areal_hpc.algo.math_verify import MathVerifier, VerifierError

TIMEOUT = 3.0


# MATH-500's solutions and answers (../shared/data/eval/math_500.jsonl, the other fields dropped), committed so
# that CI's fresh clone checks the verifier against all 500.
SOLUTIONS = Path(__file__).parent / "data" / "eval" / "math_500_solutions.jsonl"


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(n_workers=2, timeout=TIMEOUT) as pool:
        yield pool


@pytest.fixture(scope="module")
def math_500() -> list[dict]:
    with SOLUTIONS.open() as lines:
        return [json.loads(line) for line in lines]


def boxed(answer) -> str:
    return f"\\boxed{{{answer}}}"


def test_verify_scores_a_response(verifier):
    solution = r"Adding, we find $x = \boxed{\dfrac{3}{4}}$."
    assert verifier.verify(r"Thinking... so $x = \boxed{0.75}$.", [solution]) == 1.0
    assert verifier.verify(r"Thinking... so $x = \boxed{0.7}$.", [solution]) == 0.0
    assert verifier.verify("Thinking... so x = 0.75.", [solution]) == 0.0  # no stated answer, no reward


def test_the_original_numeric_rules_score_in_the_pool(verifier):
    solution = r"The chance is $\boxed{\frac{1}{3}}$."
    assert verifier.verify_batch(
        [(boxed(answer), [solution]) for answer in ("0.3333", r"33.33\%", "0.33", "33")]
    ) == [1.0, 1.0, 0.0, 0.0]
    assert verifier.verify(boxed(r"50\%"), [boxed(0.5)]) == verifier.verify(boxed(50), [boxed(0.5)]) == 1.0


def test_matching_any_solution_scores_one(verifier):
    assert verifier.verify(r"\boxed{(1,2)}", [r"\boxed{(2,1)}", r"\boxed{(1, 2)}"]) == 1.0


def test_verify_batch_keeps_the_order(verifier):
    items = [(boxed(n), [boxed(10 - n)]) for n in range(10)]
    assert verifier.verify_batch(items) == [1.0 if n == 5 else 0.0 for n in range(10)]
    assert verifier.verify_batch([]) == []


def test_usable_from_several_threads(verifier):
    results = []

    def check(n: int) -> None:
        results.append(verifier.verify_batch([(boxed(n), [boxed(n)])] * 5))

    threads = [threading.Thread(target=check, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [[1.0] * 5] * 4


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9}}",  # sympy computes a 370-million-digit integer: only the timeout stops it
        "9^{9^{9^{9^{9}}}}",
        "+".join(["x^{2}"] * 20_000),  # 100k characters
    ],
    ids=["tower3", "tower5", "100k-chars"],
)
def test_pathological_answer_scores_zero_and_the_pool_recovers(verifier, answer):
    verifier.wait_ready()  # the workers the cases before replaced have started
    start = time.monotonic()
    assert verifier.verify(boxed(answer), [boxed(1)]) == 0.0
    assert time.monotonic() - start < TIMEOUT + 1.0
    start = time.monotonic()
    assert verifier.verify(boxed(r"\frac12"), [boxed("0.5")]) == 1.0
    # The other worker answers: not stuck behind the pathological check, nor behind its replacement's start.
    assert time.monotonic() - start < TIMEOUT


def test_a_hung_check_does_not_block_the_others(verifier):
    verifier.wait_ready()
    items = [(boxed("9^{9^{9}}"), [boxed(1)]), (boxed(3), [boxed(3)]), (boxed(4), [boxed(5)])]
    start = time.monotonic()
    assert verifier.verify_batch(items) == [0.0, 1.0, 0.0]
    assert time.monotonic() - start < TIMEOUT + 1.0


def test_a_dead_worker_is_replaced(verifier):
    victim = verifier.pool._workers[0].process  # as if the kernel's OOM killer had taken it
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    assert verifier.verify_batch([(boxed(n), [boxed(n)]) for n in range(4)]) == [1.0] * 4


def test_bad_input_is_refused(verifier):
    with pytest.raises(AnswerInputError, match="solutions must be a non-empty list of strings, got '7'"):
        verifier.verify(boxed(7), "7")
    with pytest.raises(AnswerInputError, match=r"non-empty list of strings, got \[\]"):
        verifier.verify(boxed(7), [])
    with pytest.raises(AnswerInputError, match="response must be a string, got NoneType"):
        verifier.verify(None, ["7"])
    with pytest.raises(AnswerInputError, match=r"must be a \(response, solutions\) pair, got 'abc'"):
        verifier.verify_batch(["abc"])
    with pytest.raises(ValueError, match="n_workers must be a positive integer, got 0"):
        MathVerifier(n_workers=0)


def test_closed_verifier_refuses_work():
    pool = MathVerifier(n_workers=1)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(VerifierError, match="closed"):
        pool.verify(boxed(1), [boxed(1)])


# ------------------------------------------------------------------------------------------ acceptance


def test_math_500_solutions_match_their_answers(math_500, verifier):
    scores = verifier.verify_batch([(row["solution"], [boxed(row["answer"])]) for row in math_500])
    mismatched = [row["answer"] for row, score in zip(math_500, scores, strict=True) if score == 0.0]
    assert len(mismatched) <= 0.01 * len(math_500), mismatched


def test_math_500_other_answers_are_wrong(math_500, verifier):
    answers = [str(row["answer"]) for row in math_500]
    pairs = [(a, b) for a, b in zip(answers, answers[1:] + answers[:1], strict=True)]
    pairs = [(a, b) for a, b in pairs if a.replace(" ", "") != b.replace(" ", "")]
    scores = verifier.verify_batch([(boxed(a), [boxed(b)]) for a, b in pairs])
    confused = [pair for pair, score in zip(pairs, scores, strict=True) if score == 1.0]
    assert len(pairs) > 0.9 * len(answers)
    assert len(confused) <= 0.01 * len(answers), confused
