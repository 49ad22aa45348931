"""The evaluation sets (REFERENCE.md section 8): MATH-500, AIME24, AIME25 and AMC23 as JSONL files named after
them, each line a question with its ``problem`` and its ``answer`` (a string or a number), and the R1-style
instruction the original appends to every problem."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import InputError

EVAL_SETS = ("math_500", "aime24", "aime25", "amc23")
R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class EvalDataError(InputError):
    """An evaluation set that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class EvalQuestion:
    question_id: str  # "<set>-<line>", stable across runs
    problem: str
    answer: str

    @property
    def prompt(self) -> str:
        """The problem as the model is asked it."""
        return f"{self.problem}\n{R1_INSTRUCTION}"


def load_eval_set(name: str, folder: str | Path) -> list[EvalQuestion]:
    """The questions of set `name` from `folder`/`name`.jsonl (any name; the four above are shipped)."""
    path = Path(folder) / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in Path(folder).glob("*.jsonl")) if Path(folder).is_dir() else []
        raise EvalDataError(f"no evaluation set {name!r}: {path} does not exist (sets in {folder}: {known})")
    questions = []
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if line.strip():
                questions.append(_question(line, f"{name}-{lineno}", f"{path}:{lineno}"))
    if not questions:
        raise EvalDataError(f"{path}: the evaluation set holds no questions")
    return questions


def _question(line: str, question_id: str, where: str) -> EvalQuestion:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalDataError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(record, dict):
        raise EvalDataError(f"{where}: not a JSON object")
    missing = [field for field in ("problem", "answer") if field not in record]
    if missing:
        raise EvalDataError(f"{where}: no {' and no '.join(missing)} field (fields: {sorted(record)})")
    if not isinstance(record["problem"], str) or not record["problem"].strip():
        raise EvalDataError(f"{where}: 'problem' must be a non-empty string")
    answer = record["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        raise EvalDataError(f"{where}: 'answer' must be a non-empty string or a number, got {answer!r:.100}")
    return EvalQuestion(question_id, record["problem"], str(answer))  # AIME answers come as numbers
