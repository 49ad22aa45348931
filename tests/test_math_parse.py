"""Math answers: extraction, normalisation and each kind of equality, on small hand examples."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.algo.math_parse import (
    AnswerInputError,
    extract_answer,
    is_correct,
    math_equal,
    normalize_answer,
)

# ------------------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"First \boxed{1}, then finally \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"the set is \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"so the answer is $\boxed 5$.", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed {12}", "12"),
        (r"Thinking... \boxed{\frac{1}{2", None),  # cut off before the brace closed
        ("The final answer is $\\frac{3}{4}$. I hope it is correct.", r"\frac{3}{4}"),
        ("Thus the answer is 42.", "42"),
        ("So the answer is $x = 3$, as claimed.", "x = 3"),
        ("The answer is: \\(7\\)", "7"),
        ("We get 3 apples and 4 pears.", None),  # a model answer has no last-number fallback
        ("", None),
    ],
)
def test_extract_model_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        (r"Hence $x = \boxed{6}$.", "6"),
        ("We get 3 apples and 4.5 pears.", "4.5"),  # a reference falls back to its last number
        ("There are 1,000 ways.", "1,000"),
        ("No numbers here.", None),
    ],
)
def test_extract_reference_answer(solution, answer):
    assert extract_answer(solution, reference=True) == answer


# ------------------------------------------------------------------------------------------ normalisation


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"$\dfrac{1}{2}$", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac 59", r"\frac{5}{9}"),
        (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"30^\circ", "30"),
        (r"50\%", "50"),
        (r"\$32,\!348", "32348"),
        (r"11,\! 111,\! 111,\! 100", "11111111100"),
        (r"864 \mbox{ inches}^2", "864"),
        ("12 inches", "12"),
        (".35625", "0.35625"),
        ("-.5", "-0.5"),
        ("10.", "10"),
        (r"1\frac{4}{5}", r"\frac{9}{5}"),
        ("x = 5", "5"),
        ("y = 2x + 3", "2x+3"),
        (r"x \in [-2,7]", "[-2,7]"),
        (r"\cot x", r"\cot x"),
        (r"4210_{5}", "4210_5"),
        (r"\text{(E)}", "E"),
        ("(b)", "B"),
        (r"\text{East}", "east"),
    ],
)
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


# ------------------------------------------------------------------------------------------ equality

EQUAL = [
    # strings and multiple choice
    (r"\text{Navin}", "Navin"),
    ("(C)", r"\text{(C)}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    # numbers
    ("0.5", r"\frac12"),
    (".5", "0.5"),
    ("3.14159", "3.1416"),
    ("1,000", "1000"),
    (r"\$18.90", "18.9"),
    (r"137 \frac{1}{2}", "137.5"),
    # percent: x/100 and x*100
    (r"50\%", "0.5"),
    ("0.25", "25"),
    # tuples, intervals, sets, unions
    ("(1,2)", "(1, 2)"),
    ("[1,2]", "[1.0,2]"),
    ("1,-2", "-2, 1"),
    (r"3 \pm 2 \sqrt{2}", r"3-2\sqrt{2}, 3+2\sqrt{2}"),
    (r"\{1\pm\sqrt{5},-2\}", r"-2, 1+\sqrt5, 1-\sqrt5"),
    (r"(-\infty, 2) \cup (3, \infty)", r"(3,\infty)\cup(-\infty,2)"),
    # matrices and vectors
    (r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}", r"\begin{pmatrix} 0.2 \\ -3.6 \end{pmatrix}"),
    (r"\begin{bmatrix} 1 & 2 \\ 3 & 4 \end{bmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"),
    (r"\begin{pmatrix} -7 \\ 16 \\ 5 \end{pmatrix}", "(-7, 16, 5)"),
    # symbolic
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    (r"\cot x", r"\frac{\cos x}{\sin x}"),
    ("(a+5)(b+2)", "ab+2a+5b+10"),
    ("2k+2", "2(k+1)"),
    ("6+9i", "9i+6"),
    (r"2\pi", "6.2832"),
    (r"6.72\times10^{-5}", ".0000672"),
    ("y=2x+3", "2x+3"),
    (r"5x - 7y + 11z + 4 = 0", "-10x+14y-22z-8=0"),  # equations up to a constant factor
]

UNEQUAL = [
    ("C", "D"),
    ("1", "100"),  # no percent scaling between two integers without a % sign
    ("10000", "10001"),  # integers compare exactly, not within 1e-4
    ("(1,2]", "(1,2)"),  # interval brackets must match
    ("(2,1)", "(1,2)"),  # tuples are ordered
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 4 & 3 \end{pmatrix}"),
    (r"(-\infty, 2) \cup (3, \infty)", r"(-\infty, 2] \cup (3, \infty)"),
    ("x^2+2x+1", "(x+1)^3"),
    ("6+9i", "6-9i"),
    (r"\pi", "3.14"),
    (r"-\infty", r"\infty"),
    (r"10^4", "10001"),
    ("5x - 7y + 11z + 4 = 0", "5x-7y+11z=0"),
    ("52_8", "52"),  # a base-8 number is not 52
    ("east", "seat"),  # words are not products of symbols
    ("", "1"),
]


@pytest.mark.parametrize(("pred", "ref"), EQUAL)
def test_equal_answers(pred, ref):
    assert math_equal(pred, ref)
    assert math_equal(ref, pred)


@pytest.mark.parametrize(("pred", "ref"), UNEQUAL)
def test_unequal_answers(pred, ref):
    assert not math_equal(pred, ref)


@given(st.booleans(), st.integers(0, 10**6), st.integers(1, 1000))
def test_fraction_equals_its_decimal(negative, numerator, denominator):
    sign = "-" if negative else ""
    decimal = f"{sign}{numerator / denominator:.12f}"
    assert math_equal(f"{sign}\\frac{{{numerator}}}{{{denominator}}}", decimal)
    assert math_equal(f"{sign}{numerator}/{denominator}", decimal)


@given(st.integers(-(10**9), 10**9))
def test_integers_are_exact(n):
    assert math_equal(f"{n:,}", str(n))
    assert not math_equal(str(n), str(n + 1))


def test_is_correct_reads_both_texts():
    solution = r"Adding, we find $x = \boxed{\dfrac{3}{4}}$."
    assert is_correct(r"... so $x = \boxed{0.75}$", solution)
    assert not is_correct(r"... so $x = \boxed{0.7}$", solution)
    assert not is_correct("... so x = 0.75", solution)  # never stated as the final answer


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(AnswerInputError, match=r"text must be a string, got NoneType: None"):
        extract_answer(None)
    with pytest.raises(AnswerInputError, match=r"pred must be a string, got list: \['1'\]"):
        math_equal(["1"], "1")
    assert math_equal(27, "27.0")  # numbers (AIME answers are ints) are accepted
