"""The agent of the CPU toy (configs/toy-agent.yaml) and docs/agents.md's example, the same code: an async
function written only against the `openai` SDK, trained as it is through the run's OpenAI endpoint. It needs
`pip install openai` where the rollout runs.

Its calculator schema is the built-in tool's (agent.tools.CALCULATOR) word for word: the tiny model answers
only with the tools of its warm-up (configs/toy-tools-sft.yaml: the calculator alone). Its own calculator does
the + - * of the toy's questions and answers anything else with an error, as any tool may.
"""

import ast
import json
import operator

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (47 * 38) / 2"}},
            "required": ["expression"],
        },
    },
}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError("only + - * of integers")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"Error: {exc}"


async def solve(base_url, api_key, record):
    """Ask; run the calculator calls the model makes; ask again; reward 1 when the answer is right."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for _ in range(3):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
            message = response.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    answer = calculate(str(json.loads(call.function.arguments)["expression"]))
                except (ValueError, KeyError, TypeError):
                    answer = 'Error: the arguments are not {"expression": ...}'
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return float(record.solutions[0] in (message.content or ""))
