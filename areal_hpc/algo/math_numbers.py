"""The original's numeric rules for math answers, asked when Math-Verify says no (REFERENCE.md section 6).

Math-Verify compares numbers to 6 decimals and, here, reads no percent sign (latex2sympy2_extended 1.11's
parser for antlr 4.11 fails on one), so it refuses answers that the original's checker (Qwen's math grader)
takes:

- numbers within a relative 1e-4 (``math.isclose(rel_tol=1e-4)``): 0.3333 for 1/3, 3.1416 for \\pi, 1.4142
  for \\sqrt{2}; not 0.33 for 1/3, nor 3.14 for \\pi;
- a percentage and its fraction, either way: the original drops the percent sign and tries the reference
  as it is, x100 and /100, so 50\\%, 50 and 0.5 match one another; 12.5\\% is also 1/8;
- tuples, matrices, intervals (open or closed alike at each end) and sets of numbers element by element, and
  an assignment by its value: (3, 1.5708) for (3, \\frac{\\pi}{2}), x = 0.3333 for \\frac13.

Two departures, each refusing what the original takes: two integers are equal or not (100001 for 100000 is
wrong, though within 1e-4), and a number without a percent sign stands for a percentage of another only when
one of the two is not an integer (50 for 0.5, not 1 for 100).

Pure functions. `numbers_agree` reads two answers' text (the stem reward asks it alone); `answers_agree`
takes Math-Verify's sympy parses as well (`algo.math_parse.math_equal`, in a worker of the verifier's pool).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

from sympy import Basic, Eq, Expr, FiniteSet, Float, Interval, MatrixBase, Rational, Tuple, nan, zoo

REL_TOL = Fraction(1, 10_000)
# Longer text is not read as a plain number: real answers are short, and int() refuses over 4300 digits.
MAX_PLAIN_CHARS = 1000
# A decimal as written in an answer: 1000, 1,000 (thousands groups only: `1,22` is a pair), -0.5, .5, 50\%.
_PLAIN = re.compile(r"([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+)\s*(\\?%)?")


class Plain(NamedTuple):
    value: Fraction  # as written, without its percent sign
    percent: bool


def plain_number(text: str) -> Plain | None:
    """`text` as a plain decimal, with a percent sign or not; None for anything else."""
    match = _PLAIN.fullmatch(text.strip()) if len(text) <= MAX_PLAIN_CHARS else None
    return Plain(Fraction(match.group(1).replace(",", "")), bool(match.group(2))) if match else None


def close(a: Fraction, b: Fraction) -> bool:
    """Within a relative 1e-4 of the larger (math.isclose's rule, in exact arithmetic); two integers equal."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def numbers_agree(pred: str, ref: str) -> bool:
    """Whether two answers are plain numbers that match: within 1e-4, or as a percentage and its fraction."""
    p, r = plain_number(pred), plain_number(ref)
    return p is not None and r is not None and _plain_agree(p, r)


def _plain_agree(p: Plain, r: Plain) -> bool:
    pairs = [(a, b) for a in _readings(p) for b in _readings(r)]
    if p.value.denominator != 1 or r.value.denominator != 1:  # 50 for 0.5: a percentage without its sign
        pairs += [(p.value, 100 * r.value), (100 * p.value, r.value)]
    return any(close(a, b) for a, b in pairs)


def _readings(number: Plain) -> tuple[Fraction, ...]:
    """What a plain number may mean: 50\\% is 0.5, or 50 with the sign dropped, as the original drops it."""
    return (number.value / 100, number.value) if number.percent else (number.value,)


def answers_agree(pred: str, ref: str, pred_parsed: object, ref_parsed: object) -> bool:
    """Whether two answers match by the rules above: by their text when both are plain numbers, else by
    Math-Verify's parses (`*_parsed`: a sympy object, or None where it read none)."""
    p, r = plain_number(pred), plain_number(ref)
    if p is not None and r is not None:
        return _plain_agree(p, r)
    if p is None and r is None:
        return parsed_agree(pred_parsed, ref_parsed)
    # One plain number (its percent sign, which Math-Verify cannot read, counts) against an expression.
    plain, other = (p, ref_parsed) if p is not None else (r, pred_parsed)
    value = number_value(other)
    return value is not None and any(close(reading, value) for reading in _readings(plain))


def parsed_agree(a: object, b: object) -> bool:
    """Two of Math-Verify's parses: numbers by `close`, containers of one kind element by element."""
    if a is None or b is None:
        return False
    if a == b:  # an infinite end of an interval, a symbol in a tuple; not 1:00 for 12:00 (both 1/0, zoo)
        return not a.has(zoo, nan)
    if isinstance(a, Eq) or isinstance(b, Eq):
        return _equations_agree(a, b)
    if isinstance(a, Interval) and isinstance(b, Interval):
        same_kind = (a.left_open, a.right_open) == (b.left_open, b.right_open)
        return same_kind and _all_agree((a.start, a.end), (b.start, b.end))
    if isinstance(a, Tuple) and isinstance(b, Tuple):
        return _all_agree(a.args, b.args)
    if isinstance(a, MatrixBase) and isinstance(b, MatrixBase):
        return a.shape == b.shape and _all_agree(a, b)  # a matrix iterates over its entries, row by row
    if isinstance(a, FiniteSet) and isinstance(b, FiniteSet):
        return _sets_agree(a, b)
    x, y = number_value(a), number_value(b)
    return x is not None and y is not None and close(x, y)


def _all_agree(xs, ys) -> bool:
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(parsed_agree(x, y) for x, y in zip(xs, ys, strict=True))


def _sets_agree(a: FiniteSet, b: FiniteSet) -> bool:
    """Sets of real numbers, paired in order of value (on a line, the sorted pairing is the closest)."""
    xs, ys = [number_value(x) for x in a.args], [number_value(y) for y in b.args]
    if None in xs or None in ys or len(xs) != len(ys):
        return False
    return all(close(x, y) for x, y in zip(sorted(xs), sorted(ys), strict=True))


def _equations_agree(a: object, b: object) -> bool:
    """x = 0.3333 for x = 1/3 (the same left side), and for 1/3 (an answer labelled, as Math-Verify allows)."""
    if isinstance(a, Eq) and isinstance(b, Eq):
        return a.lhs == b.lhs and parsed_agree(a.rhs, b.rhs)
    equation, other = (a, b) if isinstance(a, Eq) else (b, a)
    return equation.lhs.is_Symbol and parsed_agree(equation.rhs, other)


def number_value(expr: object) -> Fraction | None:
    """The value of a real number Math-Verify parsed: exact when rational, else to 30 digits. None for anything
    else (a symbol, a set, a complex or infinite number), and for integers not written as one (2^{20}:
    Math-Verify compared those exactly, and 30 digits would not tell 10^{40} from 10^{40} + 1)."""
    if not isinstance(expr, Expr) or expr.is_Matrix or not expr.is_number:
        return None
    if isinstance(expr, Rational):
        return Fraction(int(expr.p), int(expr.q))
    if expr.is_integer:
        return None
    # A decimal as written keeps its digits (0.3333 is 3333/10000, within 1e-4 of 1/3 exactly); evaluating it to
    # 30 digits would show the tail of its binary value.
    value = expr if isinstance(expr, Float) else expr.evalf(30)
    if not value.is_Float or not value.is_finite:  # a complex value evaluates to a sum with I
        return None
    return Fraction(str(value))


def first_sympy(parsed: list) -> Basic | MatrixBase | None:
    """The sympy object of a Math-Verify parse (which holds it first, then the text), None if it has none."""
    return parsed[0] if parsed and isinstance(parsed[0], Basic | MatrixBase) else None
