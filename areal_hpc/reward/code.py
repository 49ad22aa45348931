"""The code reward (the original's rule): the answer's last fenced Python block run against every test case of
its task in the sandbox, one program per case, stopping at the first failure; success only when all pass.

    with CodeVerifier(Sandbox(Limits(time_secs=6.0)), n_workers=4) as verifier:
        verdicts = verifier.verify_batch([(answer_text, code_tests), ...])   # True / False each

A standard-input case passes when the printed output equals the expected one: as a whole once stripped, else
line by line once each line is stripped and empty lines dropped, else with each number within a relative 1e-5
of the expected (the original compares numbers with numpy's allclose). A function-call case passes when the
call's result, read back as JSON, equals the expected value (or its only element, as the original allows).
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from areal_hpc.data import CodeTests
from areal_hpc.reward.sandbox import Sandbox

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3", "")
MIN_CODE_CHARS = 20  # the original ignores shorter blocks (an inline example, a stray fence)


def extract_code(text: str) -> str | None:
    """The last fenced block tagged python (or untagged) that is Python of some length, else None."""
    for tag, body in reversed(FENCE.findall(text)):
        if tag.lower() in PYTHON_TAGS and len(body.strip()) >= MIN_CODE_CHARS:
            try:
                ast.parse(body)
            except SyntaxError:
                continue
            return body
    return None


def outputs_match(got: str, expected: str) -> bool:
    """Standard output against the expected, as the module docstring says."""
    if got.strip() == expected.strip():
        return True
    lines = [line.strip() for line in got.strip().splitlines() if line.strip()]
    want = [line.strip() for line in expected.strip().splitlines() if line.strip()]
    if lines == want:
        return True
    return len(lines) == len(want) and all(_numbers_close(a, b) for a, b in zip(lines, want, strict=True))


def _numbers_close(line: str, expected: str) -> bool:
    got, want = line.split(), expected.split()
    if len(got) != len(want):
        return False
    try:
        return all(
            math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-8)
            for a, b in zip(got, want, strict=True)
        )
    except ValueError:
        return False


def call_program(code: str, fn_name: str, marker: str) -> str:
    """A program that runs the answer, calls `fn_name` (a method of `Solution` when it has one) with the JSON
    arguments of standard input's lines, and prints the JSON result after `marker`."""
    return f"""{code}


def _areal_call():
    import json as _json, sys as _sys
    _args = [_json.loads(_line) for _line in _sys.stdin.read().strip().split("\\n") if _line.strip()]
    _target = getattr(Solution(), {fn_name!r}) if "Solution" in globals() else globals()[{fn_name!r}]
    _result = _target(*_args)
    print("\\n" + {marker!r} + _json.dumps(_result))


_areal_call()
"""


def results_match(stdout: str, marker: str, expected: str) -> bool:
    """The call's printed result against the expected JSON value (tuples read back as lists)."""
    if marker not in stdout:
        return False
    try:
        got = json.loads(stdout.rsplit(marker, 1)[1].strip())
    except json.JSONDecodeError:
        return False
    want = json.loads(expected)
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])


class CodeVerifier:
    """Scores answers to code tasks in `sandbox`, `n_workers` answers at once."""

    def __init__(self, sandbox: Sandbox, n_workers: int = 4):
        self.sandbox = sandbox
        self._pool = ThreadPoolExecutor(n_workers, thread_name_prefix="code-reward")

    def verify(self, text: str, tests: CodeTests) -> bool:
        """True when the answer's code passes every case."""
        code = extract_code(text)
        if code is None:
            return False
        for given, expected in zip(tests.inputs, tests.outputs, strict=True):
            if tests.fn_name:
                marker = f"@@areal-result-{secrets.token_hex(8)}@@"
                result = self.sandbox.run(call_program(code, tests.fn_name, marker), stdin=given)
                passed = result.ok and results_match(result.stdout, marker, expected)
            else:
                result = self.sandbox.run(code, stdin=given)
                passed = result.ok and outputs_match(result.stdout, expected)
            if not passed:
                return False
        return True

    def verify_batch(self, items: Sequence[tuple[str, CodeTests]]) -> list[bool]:
        return list(self._pool.map(lambda item: self.verify(*item), items))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CodeVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
