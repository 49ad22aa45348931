"""Stem answers as the original's math checker takes them: a multiple-choice reference (a letter A-E) matches the
last such letter the answer states, and plain numbers match by the math reward's numeric rules (within a
relative 1e-4, a percentage for its fraction: `algo.math_numbers`); anything else is the math verifier's to
judge.
"""

from __future__ import annotations

import re

from areal_hpc.algo import numbers_agree, reference_answer, response_answer

CHOICE = re.compile(r"^\(?([A-E])\)?[.:]?$")
LETTER = re.compile(r"(?<![A-Za-z\\])([A-E])(?![A-Za-z])")


def stem_verdict(response: str, solution: str) -> bool | None:
    """True or False when a letter decides it, True when the numbers match (checked here, without the math
    verifier's worker processes: plain numbers cannot hang), None to leave it to the math verifier."""
    ref = (reference_answer(solution) or "").strip()
    pred = response_answer(response)
    choice = CHOICE.match(ref)
    if choice:
        letters = LETTER.findall(pred if pred is not None else response)
        return bool(letters) and letters[-1] == choice.group(1)
    return True if pred is not None and numbers_agree(pred, ref) else None
