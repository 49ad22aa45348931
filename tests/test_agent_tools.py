"""Tool calls as the model writes them, the calculator and the python tool (in the real sandbox), and the Toolbox
that answers every call, however malformed, with text the model can read."""

from __future__ import annotations

import json
import re
import time

import pytest

from areal_hpc.agent.tools import (
    CALCULATOR,
    PYTHON,
    Tool,
    Toolbox,
    ToolCall,
    ToolError,
    content_of,
    load_tools,
    parse_tool_calls,
    to_openai,
)
from areal_hpc.config import ExtensionError

ECHO = Tool(
    "echo",
    "Say the text back.",
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    lambda arguments, session: arguments["text"],
)
SLOW = Tool(
    "slow", "Sleep a second.", {"type": "object", "properties": {}}, lambda a, s: time.sleep(1) or "done"
)
SECOND_CALCULATOR = Tool("calculator", "Another one.", {"type": "object", "properties": {}}, lambda a, s: "0")
NOT_A_TOOL = {"name": "echo"}


def block(name: str, arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def toolbox(*tools: Tool, **options) -> Toolbox:
    """Short limits; best effort so that the tests run where the node cannot isolate (here it can: as root)."""
    options = {"time_secs": 0.5, "output_chars": 200, "isolation": "best_effort", **options}
    return Toolbox([CALCULATOR, PYTHON, *tools], **options)


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, None, "call_0")


def calc(expression: str) -> str:
    return CALCULATOR.fn({"expression": expression}, {})


# --- parsing ------------------------------------------------------------------------------------------------


def test_one_call():
    [c] = parse_tool_calls(block("calculator", '{"expression": "47 * 38"}'))
    assert c == ToolCall("calculator", {"expression": "47 * 38"}, None, "call_0")


def test_two_calls_with_text_around_them():
    first, second = block("calculator", '{"expression": "1+1"}'), block("python", '{"code": "1"}')
    text = f"Let me compute.{first}\n{second} ok"
    calls = parse_tool_calls(text)
    assert [(c.name, c.id, c.error) for c in calls] == [
        ("calculator", "call_0", None),
        ("python", "call_1", None),
    ]
    assert content_of(text) == "Let me compute.\n ok"
    assert parse_tool_calls("no calls here") == [] and content_of("  just text\n") == "just text"


def test_whitespace_and_arguments_as_a_json_string():
    text = '<tool_call>{"name":"calculator","arguments":"{\\"expression\\": \\"2**10\\"}"}</tool_call>'
    assert parse_tool_calls(text)[0].arguments == {"expression": "2**10"}


def test_nested_braces_in_code_strings():
    code = "d = {'a': {'b': [1, {2: 3}]}}\nprint(d['a'])"
    [c] = parse_tool_calls(block("python", json.dumps({"code": code})))
    assert c.arguments == {"code": code} and c.error is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "'arguments' is not an object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed"),
        ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
        # What a policy writes that used to raise (RecursionError) and stop the rollout role, or to reach the
        # chat template's tojson at the next turn: nesting and text are bounded.
        ("<tool_call>" + "[" * 993 + "</tool_call>", "nested deeper than 32 levels"),
        (
            '<tool_call>{"name": "echo", "arguments": ' + '{"a": ' * 40 + "1" + "}" * 41 + "</tool_call>",
            "nested",
        ),
        ('<tool_call>{"name": "echo", "arguments": "' + "[" * 993 + '"}</tool_call>', "nested deeper"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "\\ud800"}}</tool_call>', "not valid Unicode"),
        (
            '<tool_call>{"name": "echo", "arguments": {"text": "' + "x" * 70000 + '"}}</tool_call>',
            "longer than",
        ),
    ],
)
def test_a_malformed_block_is_a_call_with_its_error(text, error):
    [c] = parse_tool_calls(text)
    assert error in c.error
    assert to_openai([c]) == []
    answer = Toolbox([ECHO]).run(c, {})
    assert answer.error and answer.text.startswith("Error: malformed tool call: ")


def test_an_unclosed_block_before_a_good_one_does_not_swallow_it():
    calls = parse_tool_calls('<tool_call>{"name": "x"' + block("calculator", '{"expression": "1"}'))
    assert "unclosed" in calls[0].error and calls[1].error is None and calls[1].id == "call_1"


def test_to_openai_keeps_the_arguments_as_a_dict():
    calls = parse_tool_calls(block("calculator", '{"expression": "1"}'))
    assert to_openai(calls) == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "1"}},
        }
    ]


# --- the calculator -----------------------------------------------------------------------------------------


def test_the_calculator_does_arithmetic():
    assert calc("47 * 38") == "1786"
    assert calc("2 + 3 * 4") == "14" and calc("(2 + 3) * 4") == "20" and calc("-2 ** 2") == "-4"
    assert calc("7 / 2") == "3.5" and calc("6 / 3") == "2" and calc("7 // 2") == "3" and calc("7 % 3") == "1"
    assert calc(" 2 ** 64 ") == "18446744073709551616" and calc("1.5e3 + 0.25") == "1500.25"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ** 1000", "exponent 1000 is too large"),
        ("(2 ** 64) ** 64 * 2 ** 64", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os')", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("(1).real", "is not allowed"),
        ("True + 1", "is not allowed"),
        ("2 ^ 3", "write ** for powers"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ToolError, match=re.escape(message)):
        calc(expression)


# --- the toolbox --------------------------------------------------------------------------------------------


def test_the_toolbox_offers_the_schemas_the_chat_template_takes():
    schemas = toolbox().schemas()
    assert [s["function"]["name"] for s in schemas] == ["calculator", "python"]
    assert schemas[0]["type"] == "function" and schemas[0]["function"]["parameters"]["required"] == [
        "expression"
    ]


def test_the_toolbox_answers_a_call():
    result = toolbox().run(parse_tool_calls(block("calculator", '{"expression": "47 * 38"}'))[0], {})
    assert (result.text, result.error) == ("1786", False) and result.secs < 1


@pytest.mark.parametrize(
    ("the_call", "message"),
    [
        (ToolCall(None, {}, "not JSON: Expecting value", "call_0"), "Error: malformed tool call: not JSON"),
        (call("search", query="x"), "Error: no tool named 'search'; the tools are: calculator, python"),
        (call("calculator"), "Error: calculator is missing argument 'expression' (takes: expression)"),
        (call("calculator", expression="1", x=2), "Error: calculator does not take argument 'x'"),
        (
            call("calculator", expression=12),
            "Error: calculator's argument 'expression' must be of type string",
        ),
        (call("calculator", expression="1/0"), "Error: division by zero"),
    ],
)
def test_every_problem_of_the_model_is_an_error_answer(the_call, message):
    result = toolbox().run(the_call, {})
    assert result.error and result.text.startswith(message), result.text


def test_a_tool_past_its_time_is_abandoned_with_an_error():
    start = time.monotonic()
    result = toolbox(SLOW, time_secs=0.2).run(call("slow"), {})
    assert result.error and "slow ran past the time limit of 0.2 s" in result.text
    assert time.monotonic() - start < 0.5


def test_a_long_answer_is_cut():
    result = toolbox(ECHO, output_chars=20).run(call("echo", text="x" * 100), {})
    assert result.text == "x" * 20 + "\n[cut: 80 more characters]" and not result.error


def test_python_prints():
    result = toolbox().run(call("python", code="print(sum(range(10)))"), {})
    assert (result.text, result.error) == ("45\n", False)


def test_python_failure_returns_the_end_of_stderr():
    result = toolbox().run(call("python", code="print('before')\n1 / 0"), {})
    assert result.error and result.text.startswith("Error: the program exited with code 1")
    assert "ZeroDivisionError: division by zero" in result.text and "stdout:\nbefore" in result.text


def test_python_state_keeps_the_variables_of_successful_cells():
    box, session = toolbox(python_state=True), {}
    assert box.run(call("python", code="x = 41\nprint('set')"), session).text == "set\n"
    assert box.run(call("python", code="y = undefined_name"), session).error  # not replayed from now on
    assert box.run(call("python", code="print(x + 1)"), session).text == "42\n"
    assert session["python_cells"] == ["x = 41\nprint('set')", "print(x + 1)"]


def test_a_cell_that_exits_does_not_stop_the_replay_of_later_ones():
    box, session = toolbox(python_state=True), {}
    assert box.run(call("python", code="import sys\nx = 1\nsys.exit(0)"), session).text == ""
    assert box.run(call("python", code="y = x + 1"), session).text == ""
    assert box.run(call("python", code="print(x, y)"), session).text == "1 2\n"


def test_without_state_every_cell_starts_afresh():
    box, session = toolbox(), {}
    box.run(call("python", code="x = 41"), session)
    result = box.run(call("python", code="print(x + 1)"), session)
    assert result.error and "NameError" in result.text


def test_an_infinite_loop_ends_at_the_time_limit():
    result = toolbox().run(call("python", code="while True:\n    pass"), {})
    assert result.error and "time limit" in result.text and result.secs < 4


# --- loading ------------------------------------------------------------------------------------------------


def test_load_tools_by_name_and_by_path():
    assert load_tools(["calculator", "python"]) == [CALCULATOR, PYTHON]
    assert load_tools([f"{__name__}:ECHO"]) == [ECHO]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ([f"{__name__}:NOT_A_TOOL"], "'rollout.tools' has .*a dict, not an areal_hpc.agent.tools.Tool"),
        (["calculator", f"{__name__}:SECOND_CALCULATOR"], "'rollout.tools' has two tools named 'calculator'"),
        (["abacus"], "'rollout.tools' is 'abacus': not a registered name"),
    ],
)
def test_load_tools_refuses_what_is_not_a_tool_of_its_own(names, message):
    with pytest.raises(ExtensionError, match=message):
        load_tools(names)
