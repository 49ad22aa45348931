"""The evaluation sets: questions read from JSONL, every bad line named by file and line."""

import json

import pytest

from areal_hpc.eval.datasets import R1_INSTRUCTION, EvalDataError, load_eval_set


def write_set(folder, name, lines):
    path = folder / f"{name}.jsonl"
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def test_a_set_is_its_questions_with_the_r1_instruction(tmp_path):
    write_set(
        tmp_path,
        "aime24",
        [{"id": 60, "problem": "Find x.", "answer": "204"}, "\n", {"problem": "p", "answer": 7}],
    )
    first, second = load_eval_set("aime24", tmp_path)
    assert (first.question_id, first.answer, second.question_id, second.answer) == (
        "aime24-1",
        "204",
        "aime24-3",
        "7",
    )
    assert first.prompt == f"Find x.\n{R1_INSTRUCTION}" and R1_INSTRUCTION.endswith("within \\boxed{}.")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"x.jsonl:2: not a JSON object"),
        ({"problem": "p"}, r"x.jsonl:2: no answer field \(fields: \['problem'\]\)"),
        ({"problem": "", "answer": "1"}, r"x.jsonl:2: 'problem' must be a non-empty string"),
        ({"problem": "p", "answer": None}, r"x.jsonl:2: 'answer' must be a non-empty string or a number"),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, message):
    write_set(tmp_path, "x", [{"problem": "p", "answer": "1"}, line])
    with pytest.raises(EvalDataError, match=message):
        load_eval_set("x", tmp_path)


def test_an_unknown_set_lists_the_ones_there(tmp_path):
    write_set(tmp_path, "math_500", [{"problem": "p", "answer": "1"}])
    with pytest.raises(EvalDataError, match=r"no evaluation set 'aime25'.*\['math_500'\]"):
        load_eval_set("aime25", tmp_path)
