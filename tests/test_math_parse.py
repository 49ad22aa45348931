"""The math reward's rule: the last box of a response against the reference's answer, by Math-Verify, and
where it says no by the original's numeric rules (relative 1e-4, percentages, sympy's values)."""

import json
import math
from pathlib import Path

import pytest
from math_verify import parse
from sympy import Expr

from areal_hpc.algo.math_numbers import numbers_agree
from areal_hpc.algo.math_parse import (
    AnswerInputError,
    is_correct,
    math_equal,
    reference_answer,
    response_answer,
)

EVAL_ANSWERS = (
    Path(__file__).parent / "golden" / "eval-answers.json"
)  # the `answer` fields of ../shared/data/eval


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"First \boxed{1}, then finally \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"the set is \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"so the answer is $\boxed 5$.", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed {12}", "12"),
        (r"Thinking... \boxed{\frac{1}{2}} wait \boxed{\frac{1}{3", None),  # the last box is cut off
        ("The final answer is $\\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),  # no box
        ("Thus the answer is 42.", "42"),
        ("So the answer is $x = 3$, as claimed.", "x = 3"),
        ("We get 3 apples and 4 pears.", None),  # no last-number fallback for a response
        ("", None),
    ],
)
def test_a_response_states_its_answer_in_its_last_box_or_after_the_answer_is(response, answer):
    assert response_answer(response) == answer


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        (r"Hence $x = \boxed{6}$.", "6"),
        (r"The pairs are \boxed{(1, 2)} and \boxed{(2, 1)}.", "(1, 2), (2, 1)"),  # every box, as a whole
        (r"\frac{14}{3}", r"\frac{14}{3}"),  # an answer field, as it stands
        ("$x=3$", "x=3"),
        (204, "204"),  # AIME answers come as ints
        (r"so \boxed{1} and \boxed{2", None),
    ],
)
def test_a_reference_answer_is_every_box_or_the_whole(solution, answer):
    assert reference_answer(solution) == answer


EQUAL = [
    ("0.5", r"\frac12"),
    ("1,000", "1000"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    ("(a+5)(b+2)", "ab+2a+5b+10"),
    (r"(-\infty, 2) \cup (3, \infty)", r"(3,\infty)\cup(-\infty,2)"),
    (r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}", r"\begin{pmatrix} 0.2 \\ -3.6 \end{pmatrix}"),
    (r"x \geq 5", r"5 \leq x"),  # relations, which the hand-written parser could not read
    (r"(p,q)=(3,2)", "(3,2)"),  # a labelled answer
    (r"\cfrac{1}{2}", "0.5"),
    (r"\text{Evelyn}", "Evelyn"),
]
UNEQUAL = [
    ("1", "100"),
    ("(1,2]", "(1,2)"),
    ("(2,1)", "(1,2)"),
    ("x^2+2x+1", "(x+1)^3"),
    (r"\pi", "3.14"),
    ("", "1"),
]


@pytest.mark.parametrize(("pred", "ref"), EQUAL)
def test_equal_answers(pred, ref):
    assert math_equal(pred, ref) and math_equal(ref, pred)


@pytest.mark.parametrize(("pred", "ref"), UNEQUAL)
def test_unequal_answers(pred, ref):
    assert not math_equal(pred, ref)


# The original's numeric rules, asked where Math-Verify says no (algo/math_numbers.py): (answer, reference).
NUMERICALLY_EQUAL = [
    ("0.3333", r"\frac{1}{3}"),  # a decimal within a relative 1e-4 (exactly 1e-4 here)
    ("3.1416", r"\pi"),  # sympy's value of an expression
    ("1.4142", r"\sqrt{2}"),
    ("-0.5236", r"-\frac{\pi}{6}"),
    ("5.0004", "5"),
    ("50", "0.5"),  # a percentage and its fraction, with its sign or without
    (r"50\%", "0.5"),
    ("50%", "0.5"),
    (r"50 \%", "50"),  # the sign dropped, as the original drops it
    (r"12.5\%", r"\frac{1}{8}"),
    (r"33.33\%", r"\frac{1}{3}"),
    ("(3, 1.5708)", r"\left( 3, \frac{\pi}{2} \right)"),  # a tuple, element by element
    ("(0.3333, 0.5)", r"(\frac{1}{3}, \frac{1}{2})"),  # an open interval
    (r"\{0.5, 0.3333\}", r"\{\frac{1}{3}, \frac{1}{2}\}"),  # a set
    (r"\begin{pmatrix} 0.3333 \\ 2 \end{pmatrix}", r"\begin{pmatrix} \frac{1}{3} \\ 2 \end{pmatrix}"),
    ("x = 0.3333", r"x = \frac{1}{3}"),  # an assignment
    ("x = 0.3333", r"\frac{1}{3}"),  # an answer labelled
]
NUMERICALLY_UNEQUAL = [
    ("0.33", r"\frac{1}{3}"),  # 1% off
    ("0.33329", r"\frac{1}{3}"),  # 1.3e-4 off
    ("3.14", r"\pi"),
    ("3.1412", r"\pi"),  # 1.2e-4 off
    ("100001", "100000"),  # two integers are equal or not (the original takes these: within 1e-4)
    ("2^{20}", "1048577"),
    (
        "1",
        "100",
    ),  # without a percent sign, two integers are not a percentage and its fraction (the original: 1)
    ("5000", r"50\%"),
    ("150", r"\frac{3}{2}"),  # without its sign, a percentage only of a plain decimal, as the original
    ("1,2", "12"),  # a pair, not twelve
    (
        "(0.3333, 0.5]",
        r"(\frac{1}{3}, \frac{1}{2})",
    ),  # an interval closed at an end that the other leaves open
    ("(0.5, 0.3333)", r"(\frac{1}{3}, \frac{1}{2})"),  # a tuple against an interval
    ("0.5", "(0, 1)"),  # a number against an interval
    (r"\{0.3333\}", r"\{\frac{1}{3}, \frac{1}{2}\}"),
    (r"\begin{pmatrix} 0.3333 & 2 \end{pmatrix}", r"\begin{pmatrix} \frac{1}{3} \\ 2 \end{pmatrix}"),
    ("y = 0.3333", r"x = \frac{1}{3}"),
    ("1:00", "12:00"),  # both parse as 1/0
]


@pytest.mark.parametrize(("pred", "ref"), NUMERICALLY_EQUAL)
def test_numbers_within_1e_4_and_percentages_are_equal_either_way(pred, ref):
    assert math_equal(pred, ref) and math_equal(ref, pred)


@pytest.mark.parametrize(("pred", "ref"), NUMERICALLY_UNEQUAL)
def test_near_misses_of_the_numeric_rules_stay_unequal_either_way(pred, ref):
    assert not math_equal(pred, ref) and not math_equal(ref, pred)


@pytest.mark.parametrize(
    ("pred", "ref", "agree"),
    [
        ("3.14159", "3.1416", True),
        ("45", "0.45", True),
        (r"45\%", "0.45", True),
        ("1,000", "1000", True),
        ("1", "100", False),
        ("3.2", "3.1416", False),
        ("1,2", "12", False),
        (r"\frac{1}{2}", "0.5", False),  # not a plain number: the math verifier's to judge
    ],
)
def test_the_stem_reward_reads_plain_numbers_by_the_same_rule(pred, ref, agree):
    assert numbers_agree(pred, ref) is agree and numbers_agree(ref, pred) is agree


def test_a_number_too_long_to_be_an_answer_is_not_read():
    assert not numbers_agree("9" * 5000, "9" * 5000)  # int() would refuse it, outside the worker processes


def test_evaluation_answers_rounded_to_4_decimals_match_where_within_1e_4():
    """Each number among the answers of the evaluation sets that is not an integer, written to 4 decimals,
    matches where that is within a relative 1e-4 of it (the original's rule), and not to 2 decimals."""
    checked = 0
    for answers in json.loads(EVAL_ANSWERS.read_text()).values():
        for answer in map(str, answers):
            value = _value(answer)
            if value is None or value.is_integer():
                continue
            for places in (4, 2):
                rounded = f"{value:.{places}f}"
                within = math.isclose(float(rounded), value, rel_tol=1e-4)
                assert is_correct(f"\\boxed{{{rounded}}}", answer) is within, (answer, rounded)
            checked += 1
    assert checked > 50


def _value(answer: str) -> float | None:
    """An answer's value where it is a real number (sympy evaluates \\frac{3}{56}, 3\\sqrt{13}, \\pi)."""
    parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if not parsed or not isinstance(parsed[0], Expr) or not parsed[0].is_number:
        return None
    value = parsed[0].evalf()
    return float(value) if value.is_real else None


def test_a_partial_answer_to_a_reference_of_several_boxes_is_wrong():
    solution = r"The solutions are $\boxed{3}$ and $\boxed{5}$."
    assert not is_correct(r"So \boxed{5}.", solution)  # the last box of the reference alone: scored 1 before
    assert is_correct(r"So \boxed{3, 5}.", solution)
    assert is_correct(r"So \boxed{\{5, 3\}}.", solution)


def test_is_correct_reads_both_texts():
    solution = r"Adding, we find $x = \boxed{\dfrac{3}{4}}$."
    assert is_correct(r"... so $x = \boxed{0.75}$", solution)
    assert not is_correct(r"... so $x = \boxed{0.7}$", solution)
    assert not is_correct("... so x = 0.75", solution)  # never stated in a box


@pytest.mark.parametrize("dataset", ["aime24", "aime25", "amc23", "math_500"])
def test_every_evaluation_answer_verifies_against_itself_and_its_boxed_form(dataset):
    for answer in json.loads(EVAL_ANSWERS.read_text())[dataset]:
        response = f"The answer is $\\boxed{{{answer}}}$."
        assert is_correct(response, answer) and is_correct(response, f"\\boxed{{{answer}}}"), answer


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(AnswerInputError, match=r"response must be a string, got NoneType: None"):
        response_answer(None)
    with pytest.raises(AnswerInputError, match=r"solution must be a string, got list: \['1'\]"):
        reference_answer(["1"])
    assert is_correct(r"\boxed{27}", 27.0)  # numbers (AMC answers are floats) are accepted
