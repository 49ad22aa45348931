"""Math answers: extraction from text, normalisation, and equality (REFERENCE.md section 6).

Everything here is pure and single-threaded. `math_equal` may call sympy, which can run for ever on
pathological input (an exponent tower), so untrusted text should go through `math_verify.MathVerifier`,
which runs these functions in worker processes under a timeout.
"""

from __future__ import annotations

import cmath
import re
from fractions import Fraction

import sympy

# Longer answers skip sympy: real answers are short, and parsing huge ones only burns the time limit.
MAX_SYMPY_CHARS = 1000
# Relative tolerance of numeric equality.
REL_TOL = Fraction(1, 10_000)


class AnswerInputError(ValueError):
    """An argument that is not text where text (or a number) is required."""


def as_text(value: object, what: str) -> str:
    """`value` as a string; numbers (AIME answers come as ints) are formatted, anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | Fraction) and not isinstance(value, bool):
        return str(value)
    raise AnswerInputError(f"{what} must be a string, got {type(value).__name__}: {value!r:.200}")


# ---------------------------------------------------------------------------------------------- extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_FINAL_ANSWER_RE = re.compile(r"final answer is\s*:?\s*\$+([^$]+)\$", re.IGNORECASE)
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*([^\n]+)", re.IGNORECASE)
_MATH_SPAN_RE = re.compile(r"\$+([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start], or None when it never closes."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":  # an escaped character (\{, \}, \\) is never structural
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} / `\\boxed 5`; None if absent or cut off."""
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    rest = text[end:]
    body = rest.lstrip()
    if body.startswith("{"):
        return _braced(text, end + len(rest) - len(body))
    bare = re.match(r"\s*([^\s$]+)", rest)
    return bare.group(1) if bare else None


def _final_answer(text: str) -> str | None:
    """The math span after the last "final answer is"."""
    matches = _FINAL_ANSWER_RE.findall(text)
    return matches[-1] if matches else None


def _answer_is(text: str) -> str | None:
    """What follows the last "answer is": its first math span, else the rest of the sentence."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    tail = matches[-1].group(1)[:500]  # the answer follows closely; a bound keeps the search linear
    span = _MATH_SPAN_RE.search(tail)
    if span:
        return next(group for group in span.groups() if group is not None)
    return re.split(r"\.(?:\s|$)", tail)[0].strip() or None


def extract_answer(text: str, reference: bool = False) -> str | None:
    """The final answer in `text`, or None.

    Looks, in order, for the last `\\boxed{...}` (braces balanced), "final answer is $...$" and
    "the answer is ...". A reference solution (`reference=True`) falls back to its last number; a model
    answer does not, so a model must state its answer to be rewarded.
    """
    text = as_text(text, "text")
    for find in (_last_boxed, _final_answer, _answer_is):
        found = find(text)
        if found is not None and found.strip():
            return found.strip()
    if reference:
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    return None


# ---------------------------------------------------------------------------------------------- normalisation

_UNIT_WORDS = (
    r"(?:square\s+|cubic\s+|sq\.?\s*)?(?:units?|cm|centimeters?|mm|km|kilometers?|meters?|inch|inches"
    r"|feet|foot|ft|yards?|miles?|mph|degrees?|radians?|dollars?|cents?|seconds?|minutes?|hours?|days?"
    r"|weeks?|months?|years?|pounds?|ounces?|grams?|kg|liters?|gallons?|people|students|ways|points)"
)
# A \text{ unit} (optionally squared) at the end of an answer that has something before it.
_TEXT_UNIT_RE = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?\s*$")
_WORD_UNIT_RE = re.compile(r"(?<=[\d}])\s*" + _UNIT_WORDS + r"(?:\^\{?\d\}?)?\s*$")
_REWRITES = [
    (r"\\(?:left|right)(?![a-zA-Z])\.?", ""),
    (r"(?<!\\)\\[!,;:]", ""),  # thin spaces, not the \\ of a matrix row
    (r"(?<!\\)\\ |~|\\q?quad(?![a-zA-Z])", " "),
    (r"\\[dt]frac(?![a-zA-Z])", r"\\frac"),
    (r"\\displaystyle(?![a-zA-Z])", ""),
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])|°", ""),
    (r"\\?%|\\\$|\$", ""),
    (r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|rm)\{([^{}]*)\}", r"\1"),
    (r"\\frac\s*([^\s{\\])", r"\\frac{\1}"),  # \frac12 -> \frac{1}2
    (r"\\frac\{([^{}]*)\}\s*([^\s{\\])", r"\\frac{\1}{\2}"),  # \frac{1}2 -> \frac{1}{2}
    (r"\\sqrt\s*([^\s{\[\\])", r"\\sqrt{\1}"),
    (r"([_^])\{(\w)\}", r"\1\2"),  # 4210_{5} -> 4210_5, x^{2} -> x^2
]
_REWRITES_RE = [(re.compile(pattern), repl) for pattern, repl in _REWRITES]
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_MIXED_RE = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_VARIABLE_PREFIX_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\w)?(?:=(?!=)|\\in(?![a-zA-Z]))")
_CHOICE_RE = re.compile(r"\(?([A-E])\)?|\(([a-e])\)")


def _squash_spaces(s: str) -> str:
    """Remove spaces, except the one a command needs before a letter (`\\cot x`)."""
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    return re.sub(r"\s+", "", s).replace("\x00", " ")


def normalize_answer(answer: str) -> str:
    """A canonical string for an answer, so that equal answers written differently compare equal.

    Strips math delimiters, `\\left`/`\\right`, thin spaces, degrees, percent and dollar signs, units,
    `\\text{}`, spaces, `x=` prefixes and trailing dots; writes `\\frac12` as `\\frac{1}{2}`, `.5` as `0.5`,
    `1,000` as `1000`, `1\\frac{4}{5}` as `\\frac{9}{5}` and a multiple-choice `(C)` as `C`.
    """
    s = as_text(answer, "answer").strip()
    if s[:2] in ("\\(", "\\[") and s[-2:] in ("\\)", "\\]"):
        s = s[2:-2].strip()
    if s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    s = _TEXT_UNIT_RE.sub("", s)
    for pattern, repl in _REWRITES_RE:
        s = pattern.sub(repl, s)
    s = _WORD_UNIT_RE.sub("", s)
    s = _squash_spaces(s).rstrip(".")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    mixed = _MIXED_RE.fullmatch(s)
    if mixed:
        sign, whole, num, den = mixed.groups()
        s = f"{sign}\\frac{{{int(whole) * int(den) + int(num)}}}{{{den}}}"
    prefix = _VARIABLE_PREFIX_RE.match(s)
    if prefix and "=" not in s[prefix.end() :] and s[prefix.end() :]:
        s = s[prefix.end() :]
    choice = _CHOICE_RE.fullmatch(s)
    if choice:
        s = (choice.group(1) or choice.group(2)).upper()
    elif re.fullmatch(r"[A-Za-z]{2,}", s):  # a word answer ("East", "\text{even}")
        s = s.lower()
    return s


# ---------------------------------------------------------------------------------------------- equality


def math_equal(pred: str, ref: str) -> bool:
    """Whether answer `pred` equals reference answer `ref` (both already extracted).

    Tries normalised string equality, numbers (relative tolerance 1e-4; also x/100 and x*100 when a percent
    sign is present or either side is not an integer), tuples, intervals, sets and matrices element-wise,
    equations up to a constant factor, and finally symbolic equality through sympy (no time limit here).
    """
    pred, ref = as_text(pred, "pred"), as_text(ref, "ref")
    percent = "%" in pred or "%" in ref
    a, b = normalize_answer(pred), normalize_answer(ref)
    return bool(a) and bool(b) and _equal(a, b, percent)


def is_correct(response: str, solution: str) -> bool:
    """Whether the model `response` states the final answer of the reference `solution`."""
    pred = extract_answer(response)
    ref = extract_answer(solution, reference=True)
    return pred is not None and ref is not None and math_equal(pred, ref)


def _equal(a: str, b: str, percent: bool) -> bool:
    if a == b:
        return True
    x, y = _to_number(a), _to_number(b)
    if x is not None and y is not None:
        return _numbers_equal(x, y, percent)
    parts_a, parts_b = _parts(a), _parts(b)
    if parts_a is not None or parts_b is not None:
        return parts_a is not None and parts_b is not None and _parts_equal(parts_a, parts_b, percent)
    return _symbolic_equal(a, b)


def _to_number(s: str) -> Fraction | None:
    """A plain number: integer, decimal, scientific, `a/b` or `\\frac{a}{b}` with integer a, b."""
    if len(s) > 100:
        return None
    frac = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if not re.fullmatch(r"-?(?:\d+/\d+|\d+(?:\.\d*)?(?:e-?\d{1,3})?|\.\d+)", s):
        return None
    try:
        return Fraction(s)
    except ZeroDivisionError:
        return None


def _numbers_equal(x: Fraction, y: Fraction, percent: bool) -> bool:
    both_integers = x.denominator == 1 and y.denominator == 1
    # Scaling by 100 reads 25 as 25% = 0.25; between two integers it would only accept wrong counts.
    scales = (1, 100, Fraction(1, 100)) if percent or not both_integers else (1,)
    for scale in scales:
        target = y * scale
        close = x == target if both_integers else abs(x - target) <= REL_TOL * max(abs(x), abs(target))
        if close:
            return True
    return False


def _split_top(s: str, separator: str) -> list[str]:
    """Split at separators outside any bracket; `(` and `[` close with either `)` or `]` (intervals)."""
    pieces, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if depth == 0 and s.startswith(separator, i):
            pieces.append(s[start:i])
            start = i = i + len(separator)
            continue
        if s[i] == "\\":  # an escaped character (\{, \\) or a command name: never a bracket
            i += 2
            continue
        depth += (s[i] in "([{") - (s[i] in ")]}")
        i += 1
    return [*pieces, s[start:]]


def _encloses(s: str) -> bool:
    """Whether s[0] is a bracket closed by s[-1] (not `(a)(b)`)."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return False
    depth = 0
    for i, char in enumerate(s):
        depth += (char in "([") - (char in ")]")
        if depth == 0:
            return i == len(s) - 1
    return False


_MATRIX_RE = re.compile(r"\\begin\{([pbB]?matrix)\}(.*)\\end\{\1\}", re.DOTALL)

# A structured answer: a kind ("()", "[)", "set", "cup", "matrix 2x2", ...) and its element strings.
Parts = tuple[str, list[str]]


def _parts(s: str) -> Parts | None:
    """The elements of a matrix, tuple, interval, union or set; None for a single expression."""
    matrix = _MATRIX_RE.fullmatch(s)
    if matrix:
        rows = [row.split("&") for row in matrix.group(2).split("\\\\") if row.strip()]
        if len({len(row) for row in rows}) != 1:
            return None
        kind = "()" if len(rows) == 1 or len(rows[0]) == 1 else f"matrix {len(rows)}x{len(rows[0])}"
        return kind, [cell for row in rows for cell in row]
    unions = _split_top(s, "\\cup")
    if len(unions) > 1:
        return "cup", unions
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _expand_pm(_split_top(s[2:-2], ","))
    if _encloses(s):
        items = _split_top(s[1:-1], ",")
        return (s[0] + s[-1], items) if len(items) > 1 else None
    items = _split_top(s, ",")
    if len(items) > 1 or "\\pm" in s:
        return "set", _expand_pm(items)
    return None


def _expand_pm(items: list[str]) -> list[str]:
    """`a\\pm b` stands for the two answers a+b and a-b."""
    out = []
    for item in items:
        head, sep, tail = item.partition("\\pm")
        out.extend([f"{head}+{tail}", f"{head}-{tail}"] if sep else [item])
    return out


def _parts_equal(a: Parts, b: Parts, percent: bool) -> bool:
    (kind_a, items_a), (kind_b, items_b) = a, b
    if kind_a != kind_b or len(items_a) != len(items_b):
        return False
    if kind_a not in ("set", "cup"):
        return all(_equal_item(x, y, percent) for x, y in zip(items_a, items_b, strict=True))
    unmatched = list(items_b)  # unordered: match each element with a distinct partner
    for x in items_a:
        partner = next((y for y in unmatched if _equal_item(x, y, percent)), None)
        if partner is None:
            return False
        unmatched.remove(partner)
    return True


def _equal_item(x: str, y: str, percent: bool) -> bool:
    x, y = x.strip(), y.strip()
    return bool(x) and bool(y) and _equal(x, y, percent)


# ---------------------------------------------------------------------------------------------- sympy

_CONSTANTS = {sympy.Symbol("pi"): sympy.pi, sympy.Symbol("i"): sympy.I, sympy.Symbol("e"): sympy.E}


def _to_sympy(s: str) -> sympy.Basic | None:
    """Parse a normalised LaTeX answer with sympy's parser; None if it cannot be read."""
    from sympy.parsing.latex import parse_latex  # loads the antlr parser; kept out of import time

    latex = s.replace("\\infty", "\\infty ").replace("\\cdot", "\\cdot ")
    try:
        return parse_latex(latex).subs(_CONSTANTS)
    except Exception:  # the parser raises many kinds of errors on text that is not maths
        return None


def _symbolic_equal(a: str, b: str) -> bool:
    if max(len(a), len(b)) > MAX_SYMPY_CHARS:
        return False
    # Base subscripts (52_8) and words would be misread as products: only string equality applies.
    if any(re.search(r"\d_|^[A-Za-z]{2,}$", s) for s in (a, b)):
        return False
    x, y = _to_sympy(a), _to_sympy(b)
    if x is None or y is None:
        return False
    try:
        return _sympy_equal(x, y)
    except Exception:  # sympy raises TypeError, ValueError, ... on expressions it cannot compare
        return False


def _sympy_equal(x: sympy.Basic, y: sympy.Basic) -> bool:
    if x == y:
        return True
    if isinstance(x, sympy.Eq) and isinstance(y, sympy.Eq):
        # Equations are equal up to a constant factor: 2x+2y=4 is x+y=2.
        ratio = sympy.simplify((x.lhs - x.rhs) / (y.lhs - y.rhs))
        return not ratio.free_symbols and bool(ratio.is_finite) and ratio != 0
    if isinstance(x, sympy.core.relational.Relational) or isinstance(y, sympy.core.relational.Relational):
        return False
    diff = x - y
    if not diff.free_symbols and not (x.is_integer and y.is_integer):
        u, v = complex(sympy.N(x)), complex(sympy.N(y))
        if not (cmath.isfinite(u) and cmath.isfinite(v)):
            return u == v
        return abs(u - v) <= float(REL_TOL) * max(abs(u), abs(v))
    return sympy.simplify(diff) == 0 or bool(x.equals(y))


def warm_up() -> None:
    """Load the LaTeX parser and sympy's caches so the first real check is not slow."""
    math_equal("\\frac{x}{2}", "x/2")
