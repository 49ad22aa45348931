"""The math reward's rule (REFERENCE.md section 6): the last ``\\boxed{}`` of a response against the reference's
answer, judged by Math-Verify, Hugging Face's LaTeX parser and comparator (the library the field scores
with).

- The response's answer is its last ``\\boxed{...}`` (or ``\\fbox``, or ``\\boxed 5``); without a box, what
  follows the last "final answer is $...$" or "the answer is"; the original's rules. A response with none of
  them, or whose last box is cut off, scores 0.
- The reference's answer is every box it holds, as a whole: ``\\boxed{3} and \\boxed{5}`` is the pair (3, 5),
  so a response with one of them is wrong. A reference without a box is its answer as it stands (the
  ``answer`` fields of the evaluation sets: ``\\frac{1}{2}``, ``$x=3$``, 204).
- Each answer is parsed in a box by ``math_verify.parse``, and ``math_verify.verify`` compares them (numbers
  to 6 decimals, fractions, sets and intervals, equations and relations, matrices, units and text dropped).
- Where Math-Verify says no, the original's numeric rules have their say (``algo.math_numbers``): numbers
  within a relative 1e-4 (0.3333 for 1/3, 3.1416 for \\pi), a percentage for its fraction (50\\% or 50 for
  0.5), element by element in tuples, intervals, matrices and sets.

Everything here is pure and single-threaded. sympy can run for ever on a pathological answer, so untrusted
text goes through ``algo.math_verify.MathVerifier``, which runs ``is_correct`` in worker processes and kills
one that overruns; Math-Verify's own alarm-based timeouts are off, so that one mechanism decides.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from math_verify import LatexExtractionConfig, parse, verify

from areal_hpc.algo.math_numbers import answers_agree, first_sympy

# It warns at every call that its own timeouts are off, which they are on purpose (the pool's are on).
logging.getLogger("math_verify").setLevel(logging.ERROR)

# Longer answers are not parsed: real answers are short, and parsing huge ones only burns the time limit.
MAX_ANSWER_CHARS = 1000
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_FINAL_ANSWER_RE = re.compile(r"final answer is\s*:?\s*\$+([^$]+)\$", re.IGNORECASE)
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*([^\n]+)", re.IGNORECASE)
_MATH_SPAN_RE = re.compile(r"\$+([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")
_EXTRACT = [LatexExtractionConfig(boxed_match_priority=0)]


class AnswerInputError(ValueError):
    """An argument that is not text where text (or a number) is required."""


def as_text(value: object, what: str) -> str:
    """`value` as a string; numbers (AIME answers come as ints) are formatted, anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | Fraction) and not isinstance(value, bool):
        return str(value)
    raise AnswerInputError(f"{what} must be a string, got {type(value).__name__}: {value!r:.200}")


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


def boxes(text: str) -> list[str | None]:
    """The content of each ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5`` in `text`, None for one cut off."""
    found = []
    for match in _BOXED_RE.finditer(text):
        rest = text[match.end() :]
        body = rest.lstrip()
        if body.startswith("{"):
            found.append(_braced(text, match.end() + len(rest) - len(body)))
        else:
            bare = re.match(r"\s*([^\s$]+)", rest)
            found.append(bare.group(1) if bare else None)
    return found


def response_answer(response: str) -> str | None:
    """The answer a response states: its last box, else its last "final answer is" / "the answer is"."""
    response = as_text(response, "response")
    found = boxes(response)
    if found:
        return found[-1]
    final = _FINAL_ANSWER_RE.findall(response)
    return final[-1].strip() if final else _answer_is(response)


def _answer_is(text: str) -> str | None:
    """What follows the last "answer is": its first math span, else the rest of the sentence."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    tail = matches[-1].group(1)[:500]  # the answer follows closely; a bound keeps the search linear
    span = _MATH_SPAN_RE.search(tail)
    if span:
        return next(group for group in span.groups() if group is not None).strip()
    return re.split(r"\.(?:\s|$)", tail)[0].strip() or None


def reference_answer(solution: str) -> str | None:
    """The answer of a reference solution: all its boxes as one (None if one is cut off), else itself."""
    solution = as_text(solution, "solution").strip()
    found = boxes(solution)
    if not found:
        return unwrapped(solution) or None
    return None if None in found else ", ".join(found)


def unwrapped(text: str) -> str:
    """`text` without one pair of ``$``/``$$`` around it."""
    for delimiter in ("$$", "$"):
        if len(text) > 2 * len(delimiter) and text.startswith(delimiter) and text.endswith(delimiter):
            return text[len(delimiter) : -len(delimiter)].strip()
    return text


def _parsed(answer: str) -> list:
    return parse(f"\\boxed{{{answer}}}", _EXTRACT, parsing_timeout=None)


def math_equal(pred: str, ref: str) -> bool:
    """Whether two final answers (LaTeX, no box around them) are the same: by Math-Verify, else by the
    original's numeric rules (``algo.math_numbers``), on top of it: what Math-Verify accepts stays accepted."""
    if not pred.strip() or not ref.strip() or max(len(pred), len(ref)) > MAX_ANSWER_CHARS:
        return False
    gold, answer = _parsed(ref), _parsed(pred)
    if verify(gold, answer, timeout_seconds=None):
        return True
    return answers_agree(pred, ref, first_sympy(answer), first_sympy(gold))


def is_correct(response: str, solution: str) -> bool:
    """Whether the model `response` states the final answer of the reference `solution`."""
    pred, ref = response_answer(response), reference_answer(solution)
    return pred is not None and ref is not None and math_equal(pred, ref)


def warm_up() -> None:
    """Load the LaTeX parser and sympy's caches so the first real check is not slow."""
    math_equal("\\frac{x}{2}", "x/2")
