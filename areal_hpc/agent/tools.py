"""Tool calls in the Qwen chat template's format, and the tools a model may call (calculator, python).

    calls = parse_tool_calls(turn_text)        # each <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    toolbox = Toolbox(load_tools(["calculator", "python"]), time_secs=5.0, output_chars=1024)
    session = {}                               # one per episode: tools keep their state in it
    results = [toolbox.run(call, session) for call in calls]   # ToolResult(text, error, secs), never raises

Whatever the model writes is answered, never raised: a malformed call, an unknown tool, wrong arguments, a tool
that fails or runs too long all come back as text starting "Error:" with `error=True`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from areal_hpc.agent import bounds
from areal_hpc.config import ExtensionError, InputError, extensions
from areal_hpc.reward import Limits, Result, Sandbox

# A block ends at its closing tag, or (unclosed) where the next block or the text begins/ends.
BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
FORMAT_HINT = 'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
MAX_CALL_CHARS = 65536  # one call's JSON: a program for the python tool fits many times over


class ToolError(Exception):
    """A tool's answer that the call failed; its message goes back to the model."""


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict
    error: str | None  # why the call is malformed; None when well formed
    id: str  # "call_0", "call_1", ... by position in the turn (an episode numbers them through its turns)


@dataclass(frozen=True)
class ToolResult:
    text: str  # the `tool` message's content
    error: bool
    secs: float


# --- parsing ------------------------------------------------------------------------------------------------


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of `text`, in order; a malformed one has `error` set. Never raises: the text is
    the policy's, and whatever it writes is the model's mistake to hear about."""
    calls = []
    for i, match in enumerate(BLOCK.finditer(text)):
        try:
            calls.append(_parse_block(match.group(1), bool(match.group(2)), f"call_{i}"))
        except Exception as exc:  # a reading this module did not foresee is still only a malformed call
            calls.append(ToolCall(None, {}, f"cannot be read ({type(exc).__name__}: {exc})", f"call_{i}"))
    return calls


def _parse_block(body: str, closed: bool, cid: str) -> ToolCall:
    if not closed:
        return ToolCall(None, {}, "unclosed <tool_call> block (no </tool_call>)", cid)
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, {}, f"longer than {MAX_CALL_CHARS} characters", cid)
    try:
        obj = bounds.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, {}, f"not JSON: {exc}", cid)
    except ValueError as exc:  # too deep, or text that is not Unicode
        return ToolCall(None, {}, f"not usable JSON: {exc}", cid)
    if not isinstance(obj, dict):
        return ToolCall(None, {}, "not a JSON object", cid)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, "no 'name'", cid)
    args = obj.get("arguments", {})
    # Some models write the arguments as a JSON string, as the OpenAI API carries them.
    if isinstance(args, str):
        try:
            args = bounds.loads(args)
        except ValueError as exc:
            return ToolCall(name, {}, f"'arguments' is a string that is not usable JSON: {exc}", cid)
    if not isinstance(args, dict):
        return ToolCall(name, {}, "'arguments' is not an object", cid)
    return ToolCall(name, args, None, cid)


def content_of(text: str) -> str:
    """The turn's text outside its tool-call blocks: the assistant message's `content`."""
    return BLOCK.sub("", text).strip()


def to_openai(calls: list[ToolCall]) -> list[dict]:
    """The well-formed calls as an assistant message's `tool_calls`. `arguments` stays a dict, not the OpenAI
    API's JSON string: Qwen2.5's template renders it with `| tojson`, which would quote a string, and Qwen3's
    takes either, so a dict renders the call as the model wrote it in both."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
        if c.error is None
    ]


# --- tools --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A tool the model may call. `fn(arguments, session)` returns the answer or raises ToolError; it runs in a
    thread, `session` is the episode's dict (its state, and what the Toolbox provides: "sandbox", a callable
    giving the shared Sandbox, and "python_state"). `limits_itself`: the tool keeps its own time limit (a
    sandbox's), so the Toolbox waits for it instead of abandoning it at `time_secs`."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments
    fn: Callable[[dict, dict], str]
    limits_itself: bool = False

    def schema(self) -> dict:
        """The OpenAI function schema that `apply_chat_template(tools=...)` takes."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


MAX_EXPONENT = 64
MAX_BITS = 4096  # an integer result of more bits is refused (its digits would swamp the context anyway)
BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
ALLOWED = "only numbers, + - * / // % ** and parentheses are allowed"


def _calculate(arguments: dict, session: dict) -> str:
    try:
        value = _evaluate(ast.parse(arguments["expression"].strip(), mode="eval").body)
    except (SyntaxError, ValueError) as exc:  # ValueError: a null byte
        raise ToolError(f"not an arithmetic expression: {getattr(exc, 'msg', exc)}") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError, MemoryError):
        raise ToolError("the expression or its result is too large") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))  # "1786", not "1786.0"
    return repr(value)


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic expression's tree; anything but numbers and the operators is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right!r} is too large (at most {MAX_EXPONENT} in size)")
        return _checked(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not supported: write ** for powers")
    raise ToolError(f"{ast.unparse(node)!r} is not allowed: {ALLOWED}")


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is too large")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ToolError(f"the result is too large (more than {MAX_BITS} bits)")
    return value


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (47 * 38) / 2"}},
        "required": ["expression"],
    },
    fn=_calculate,
)

STDERR_LINES = 8


def _run_python(arguments: dict, session: dict) -> str:
    """The cell's stdout. With python_state the episode's earlier successful cells run first, their output
    discarded, so their names persist; only a cell that succeeds joins them, so a failure cannot break them."""
    code = arguments["code"]
    cells = session.setdefault("python_cells", []) if session.get("python_state") else None
    sandbox: Sandbox = session["sandbox"]()
    result = sandbox.run(_with_state(cells, code) if cells is not None else code)
    if not result.ok:
        raise ToolError(_failure(result, sandbox.limits))
    if cells is not None:
        cells.append(code)
    return result.stdout


def _with_state(cells: list[str], code: str) -> str:
    """A program running `cells` quietly, then `code`, all in one namespace."""
    return (
        "import io as _io, sys as _sys\n"
        "_ns = {'__name__': '__main__'}\n"
        "_sys.stdout, _sys.stderr = _io.StringIO(), _io.StringIO()\n"
        f"for _cell in {cells!r}:\n"
        "    try:\n"
        "        exec(compile(_cell, '<earlier cell>', 'exec'), _ns)\n"
        "    except SystemExit:\n"  # a cell that ended with sys.exit(0) must not end the later ones
        "        pass\n"
        "_sys.stdout, _sys.stderr = _sys.__stdout__, _sys.__stderr__\n"
        f"exec(compile({code!r}, '<cell>', 'exec'), _ns)\n"
    )


def _failure(result: Result, limits: Limits) -> str:
    """What went wrong: the limit hit or the exit code, the last lines of stderr, then what it printed."""
    if result.limit == "time":
        how = f"the program ran past the time limit ({limits.time_secs:g} s of CPU)"
    elif result.limit:
        how = f"the program hit the {result.limit} limit"
    else:
        how = f"the program exited with code {result.returncode}"
    tail = "\n".join(result.stderr.rstrip().splitlines()[-STDERR_LINES:])
    out = f"\nstdout:\n{result.stdout}" if result.stdout else ""
    return f"{how}\n{tail}{out}".rstrip()


PYTHON = Tool(
    name="python",
    description="Run a Python 3 program (standard library only, no network) and return what it prints.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print what you need to see"}},
        "required": ["code"],
    },
    fn=_run_python,
    limits_itself=True,
)


# --- running calls ------------------------------------------------------------------------------------------

_sandboxes: dict[tuple[Limits, str], Sandbox] = {}
_sandboxes_lock = threading.Lock()


def shared_sandbox(limits: Limits, isolation: str = "required") -> Sandbox:
    """One Sandbox per process for these limits, built on first use (it probes the node) and shared: it is
    thread-safe. IsolationError where isolation is required and the node cannot isolate."""
    with _sandboxes_lock:
        if (limits, isolation) not in _sandboxes:
            _sandboxes[limits, isolation] = Sandbox(limits, isolation=isolation)
        return _sandboxes[limits, isolation]


JSON_TYPES = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
}  # fmt: skip


class Toolbox:
    """The tools of a run and how their calls are answered (rollout.tools, tool_time_secs, python_state,
    max_tool_output_chars; reward.code_memory_mb and code_isolation for the python sandbox)."""

    def __init__(
        self,
        tools: list[Tool],
        *,
        time_secs: float = 5.0,
        output_chars: int = 1024,
        python_state: bool = False,
        memory_mb: int = 1024,
        isolation: str = "required",
        sandbox_factory: Callable[[], Sandbox] | None = None,
    ):
        self.tools = {tool.name: tool for tool in tools}
        self.time_secs, self.output_chars, self.python_state = time_secs, output_chars, python_state
        limits = Limits(time_secs=time_secs, memory_mb=memory_mb)
        self.sandbox = sandbox_factory or (lambda: shared_sandbox(limits, isolation))

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]

    def run(self, call: ToolCall, session: dict) -> ToolResult:
        """The answer to one call. Raises only for the site's problems (InputError: the sandbox cannot
        isolate), never for the model's."""
        start = time.monotonic()
        session.setdefault("sandbox", self.sandbox)
        session.setdefault("python_state", self.python_state)
        text, error = self._answer(call, session)
        if len(text) > self.output_chars:
            text = f"{text[: self.output_chars]}\n[cut: {len(text) - self.output_chars} more characters]"
        return ToolResult(text, error, time.monotonic() - start)

    def _answer(self, call: ToolCall, session: dict) -> tuple[str, bool]:
        if call.error is not None:
            return f"Error: malformed tool call: {call.error}; {FORMAT_HINT}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: no tool named {call.name!r}; the tools are: {', '.join(self.tools)}", True
        problem = _arguments_problem(tool, call.arguments)
        if problem:
            return f"Error: {problem}", True
        try:
            return self._call(tool, call.arguments, session), False
        except ToolError as exc:
            return f"Error: {exc}", True
        except InputError:
            raise
        except Exception as exc:  # a tool's bug: the model still gets an answer
            return f"Error: {tool.name} failed: {type(exc).__name__}: {exc}", True

    def _call(self, tool: Tool, arguments: dict, session: dict) -> str:
        """Run the tool, in a thread abandoned at `time_secs` unless it limits itself."""
        if tool.limits_itself:
            return str(tool.fn(arguments, session))
        outcome: list = []

        def target() -> None:
            try:
                outcome.append((True, tool.fn(arguments, session)))
            except BaseException as exc:
                outcome.append((False, exc))

        thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
        thread.start()
        thread.join(self.time_secs)
        if not outcome:
            raise ToolError(f"{tool.name} ran past the time limit of {self.time_secs:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return str(value)


def _arguments_problem(tool: Tool, arguments: dict) -> str | None:
    """What is wrong with the arguments by the tool's schema (names, required ones, simple types), or None.
    Unlike JSON schema's default, names outside `properties` are refused unless additionalProperties allows them:
    a misspelt argument is the model's mistake to hear about."""
    props = tool.parameters.get("properties", {})
    takes = f"(takes: {', '.join(props) or 'no arguments'})"
    for name in tool.parameters.get("required", []):
        if name not in arguments:
            return f"{tool.name} is missing argument {name!r} {takes}"
    for name, value in arguments.items():
        if name not in props:
            if tool.parameters.get("additionalProperties", False) is False:
                return f"{tool.name} does not take argument {name!r} {takes}"
            continue
        want = JSON_TYPES.get(props[name].get("type"))
        if want and (not isinstance(value, want) or (isinstance(value, bool) and want is not bool)):
            return f"{tool.name}'s argument {name!r} must be of type {props[name]['type']}"
    return None


def load_tools(names: list[str]) -> list[Tool]:
    """The tools rollout.tools names (registered names or 'module:attribute'), each a Tool of its own name."""
    tools: dict[str, tuple[str, Tool]] = {}
    for spec in names:
        tool = extensions.load("rollout.tools", spec)
        if not isinstance(tool, Tool):
            raise ExtensionError(
                f"'rollout.tools' has {spec!r}, a {type(tool).__name__}, not an areal_hpc.agent.tools.Tool"
            )
        if tool.name in tools:
            raise ExtensionError(
                f"'rollout.tools' has two tools named {tool.name!r}: {tools[tool.name][0]!r} and {spec!r}"
            )
        tools[tool.name] = (spec, tool)
    return [tool for _, tool in tools.values()]
