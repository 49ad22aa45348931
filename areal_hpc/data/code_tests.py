"""The test cases of a code task, in the format of the original's code data (its `input_output` field).

    {"query_id": "c1", "task": "code", "prompt": "...",
     "input_output": "{\\"inputs\\": [\\"1 2\\\\n\\"], \\"outputs\\": [\\"3\\\\n\\"]}"}

`input_output` is a JSON object, or a string holding one, with equal-length lists `inputs` and `outputs` of
strings. Without `fn_name` each input is the program's standard input and its output the expected standard
output; with `fn_name` the answer defines that function (or a method of `class Solution`), each line of an
input is one JSON argument of a call, and the output the call's JSON result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class CodeTestsError(ValueError):
    """An `input_output` value that is not a valid set of test cases; the message says what is wrong."""


@dataclass(frozen=True)
class CodeTests:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn_name: str | None = None

    def __len__(self) -> int:
        return len(self.inputs)


def parse_code_tests(value: Any) -> CodeTests:
    """The test cases of an `input_output` value (a JSON object or its text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise CodeTestsError(f"a string that is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise CodeTestsError(f"expected an object with 'inputs' and 'outputs', got {type(value).__name__}")
    inputs, outputs, fn_name = value.get("inputs"), value.get("outputs"), value.get("fn_name")
    for key, cases in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(cases, list) or not all(isinstance(c, str) for c in cases):
            raise CodeTestsError(f"'{key}' must be a list of strings")
    if not inputs or len(inputs) != len(outputs):
        raise CodeTestsError(
            f"needs one output per input and at least one case, got {len(inputs)} and {len(outputs)}"
        )
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise CodeTestsError(f"'fn_name' must be a Python function name, got {fn_name!r}")
    if fn_name:
        for i, (given, expected) in enumerate(zip(inputs, outputs, strict=True)):
            try:
                [json.loads(line) for line in given.strip().split("\n") if line.strip()]
                json.loads(expected)
            except json.JSONDecodeError as e:
                raise CodeTestsError(
                    f"case {i}: a function call's arguments and result must be JSON ({e})"
                ) from None
    return CodeTests(tuple(inputs), tuple(outputs), fn_name or None)
