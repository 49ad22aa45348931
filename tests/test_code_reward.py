"""The code reward: the answer's last Python block against every test case of its task, in the sandbox."""

from __future__ import annotations

import pytest

from areal_hpc.config import InputError, RewardConfig
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.data import CodeTests, PromptSample
from areal_hpc.launch.local import run_local
from areal_hpc.reward import (
    CodeVerifier,
    IsolationError,
    Limits,
    Sandbox,
    TaskRewards,
    extract_code,
    outputs_match,
)
from areal_hpc.reward.stem import stem_verdict
from tests.test_sandbox import HOSTILE

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
ADD_TESTS = CodeTests(("1 2\n", "40 2\n"), ("3\n", "42\n"))


def answer(code: str, tag: str = "python") -> str:
    return f"Let me think.\n```{tag}\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def verifier():
    with CodeVerifier(Sandbox(Limits(time_secs=1.0)), n_workers=4) as v:
        yield v


def test_the_last_python_block_of_some_length_is_the_answer():
    first, last = "print('first answer')", "print('second answer')"
    assert extract_code(answer(first) + answer(last)) == last + "\n"
    assert extract_code(answer(last, tag="")) == last + "\n"  # untagged
    assert extract_code(answer(last) + answer("x = 1")) == last + "\n"  # too short to be an answer
    assert extract_code(answer(last) + answer("def broken(:\n    pass")) == last + "\n"  # not Python
    assert extract_code(answer("int main() { return 0; }", tag="cpp")) is None
    assert extract_code("no code at all") is None


def test_outputs_match_as_the_original_compares_them():
    assert outputs_match("3\n\n", "3")
    assert outputs_match("1 2  \n\n3\n", "1 2\n3\n")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("0.34\n", "0.33")
    assert not outputs_match("3\n4\n", "3\n")


def test_a_program_passes_only_when_every_case_does(verifier):
    assert verifier.verify(ADD, ADD_TESTS)
    off_by_one = ADD.replace("a + b", "a + b + (a == 40)")
    assert not verifier.verify(off_by_one, ADD_TESTS)
    assert not verifier.verify("I do not know.", ADD_TESTS)


def test_function_call_cases_call_the_function_or_the_solution_method(verifier):
    tests = CodeTests(("[1, 2, 3]\n2", "[]\n5"), ("[3, 4, 5]", "[]"), fn_name="shift")
    plain = answer("def shift(xs, k):\n    return [x + k for x in xs]")
    method = answer("class Solution:\n    def shift(self, xs, k):\n        return tuple(x + k for x in xs)")
    assert verifier.verify(plain, tests) and verifier.verify(method, tests)  # tuples read back as lists
    assert not verifier.verify(answer("def shift(xs, k):\n    return xs"), tests)
    forged = answer("print('@@areal-result-0@@[3, 4, 5]')\ndef shift(xs, k):\n    return xs")
    assert not verifier.verify(forged, tests)  # the marker is drawn per run


@pytest.mark.parametrize("name", HOSTILE)
def test_each_hostile_program_scores_zero_as_an_answer(verifier, name):
    assert not verifier.verify(answer(HOSTILE[name]), ADD_TESTS)
    assert verifier.verify(ADD, ADD_TESTS)  # the pool keeps serving


def test_hostile_answers_score_zero_and_the_rest_of_the_batch_is_scored(verifier):
    loop, bomb = answer("while True:\n    pass"), answer("import os\nwhile True:\n    os.fork()")
    verdicts = verifier.verify_batch(
        [(loop, ADD_TESTS), (ADD, ADD_TESTS), (bomb, ADD_TESTS), (ADD, ADD_TESTS)]
    )
    assert verdicts == [False, True, False, True]


def test_each_answer_is_scored_by_its_task():
    math = PromptSample("m", "What is 1 + 1?", (1,), "math", ("\\boxed{2}",))
    stem = PromptSample("s", "Which is a noble gas? A) N B) Ne", (1,), "stem", ("\\boxed{B}",))
    code = PromptSample("c", "Add two numbers.", (1,), "code", (), ADD_TESTS)
    with TaskRewards(RewardConfig(code_time_secs=1.0)) as rewards:
        items = [
            ("\\boxed{2}", math),
            ("\\boxed{3}", math),
            ("So the answer is (B).", stem),
            ("\\boxed{A}", stem),
            (ADD, code),
            ("\\boxed{3}", code),
        ]
        assert rewards.score_batch([(text, prompt, [1, 2]) for text, prompt in items]) == [
            1.0,
            0.0,
            1.0,
            0.0,
            1.0,
            0.0,
        ]


@pytest.mark.parametrize(
    "response, solution, verdict",
    [
        ("The answer is \\boxed{B}", "\\boxed{B}", True),
        ("Answer: (C). Not B? No, C.", "B", False),  # the last letter it states
        ("I pick B) neon", "(B)", True),
        ("\\boxed{3.14159}", "\\boxed{3.1416}", True),  # within 1e-4
        ("\\boxed{45}", "\\boxed{0.45}", True),  # a percentage
        ("\\boxed{3.2}", "\\boxed{3.1416}", None),  # the math verifier decides
        ("\\boxed{x^2}", "\\boxed{x \\cdot x}", None),
    ],
)
def test_stem_letters_and_numbers_as_the_original_takes_them(response, solution, verdict):
    assert stem_verdict(response, solution) is verdict


def test_a_run_with_code_tasks_on_a_machine_that_cannot_isolate_stops_before_it_writes_anything(
    toy, tiny_build, tmp_path, monkeypatch
):
    monkeypatch.setenv("PATH", str(tmp_path / "no-unshare"))  # util-linux's unshare is not on it
    cfg = toy.config("unisolated", 1, f"dataset.path={tiny_build.root / 'data' / 'code' / 'train.jsonl'}")
    with pytest.raises(
        InputError, match="'reward.code_isolation': reward.code_isolation is required"
    ) as refused:
        run_local(cfg)
    assert "reward.code_isolation=best_effort" in str(refused.value) and not run_dir_of(cfg).root.exists()


def test_a_role_that_scores_code_where_it_cannot_isolate_fails_for_good_or_warns_with_best_effort(
    tmp_path, monkeypatch, caplog
):
    """A Slurm job's roles find it on their nodes: an InputError ends the job without retries."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(IsolationError) as refused:
        TaskRewards(RewardConfig(), tasks={"math", "code"})
    assert isinstance(refused.value, InputError)
    with TaskRewards(RewardConfig(code_isolation="best_effort"), tasks={"code"}) as rewards:
        assert "NOT isolated" in caplog.text and caplog.records[-1].levelname == "WARNING"
        code = PromptSample("c", "Add two numbers.", (1,), "code", (), ADD_TESTS)
        assert rewards.score_batch([(ADD, code, ())]) == [1.0]
    with TaskRewards(RewardConfig(), tasks={"math"}):  # no code task: no sandbox is made
        pass
