"""The math reward's rule: the last box of a response against the reference's answer, by Math-Verify."""

import json
from pathlib import Path

import pytest

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
