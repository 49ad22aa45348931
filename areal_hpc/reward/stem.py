"""Stem answers as the original's math checker takes them: a multiple-choice reference (a letter A-E) matches the
last such letter the answer states, and numbers match within a relative 1e-4, also as percentages (x100,
/100); anything else is the math verifier's to judge.
"""

from __future__ import annotations

import math
import re

from areal_hpc.algo import reference_answer, response_answer

CHOICE = re.compile(r"^\(?([A-E])\)?[.:]?$")
LETTER = re.compile(r"(?<![A-Za-z\\])([A-E])(?![A-Za-z])")


def stem_verdict(response: str, solution: str) -> bool | None:
    """True or False when a letter or a number decides it, None to leave it to the math verifier."""
    ref = (reference_answer(solution) or "").strip()
    pred = response_answer(response)
    choice = CHOICE.match(ref)
    if choice:
        letters = LETTER.findall(pred if pred is not None else response)
        return bool(letters) and letters[-1] == choice.group(1)
    want, got = _number(ref), _number(pred or "")
    if want is None or got is None:
        return None
    close = any(math.isclose(got, want * scale, rel_tol=1e-4, abs_tol=1e-12) for scale in (1, 100, 0.01))
    return True if close else None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("\\%", "").rstrip("%").strip())
    except ValueError:
        return None
