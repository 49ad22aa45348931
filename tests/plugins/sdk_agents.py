"""Agents written only against the `openai` SDK, as users write them (this folder on PYTHONPATH): they know
nothing of areal_hpc but the base URL, the key and the dataset record they are given (and the calculator of the
shipped example agent, areal_hpc/agent/toy_agent.py, which is SDK code too)."""

import asyncio
import json
import re

import httpx
import openai

from areal_hpc.agent.toy_agent import CALCULATOR, calculate  # the shipped example's tool, its own calculator

SEEN: dict[str, list] = {}  # api key -> the responses its episode got (for the tests to compare)


def boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^}]*)\}", text or "")
    return found[-1] if found else None


async def calculator_agent(base_url, api_key, record):
    """Ask, run the calculator calls the model makes, ask again: two model turns at most."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for _ in range(2):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR]
            )
            SEEN.setdefault(api_key, []).append(response)
            message = response.choices[0].message
            messages.append(message)
            if response.choices[0].finish_reason != "tool_calls":
                break
            for call in message.tool_calls:
                try:
                    expression = json.loads(call.function.arguments)["expression"]
                    answer = calculate(str(expression))
                except (ValueError, KeyError, TypeError):
                    answer = 'Error: the arguments are not {"expression": ...}'
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        return float(boxed(message.content) == boxed(record.solutions[0]))


async def three_turns(base_url, api_key, record):
    """Three turns whatever the model says: a tool answer after each of the first two."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for turn in range(3):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR], max_tokens=12
            )
            SEEN.setdefault(api_key, []).append(response)
            messages.append(response.choices[0].message)
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn)})
        return 1.0


async def asks_wrongly_then_right(base_url, api_key, record):
    """A malformed request, a wrong key and an unknown model, each caught as the SDK's error, then a good call."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        errors = []
        for bad in (
            lambda: client.chat.completions.create(model="policy", messages=[]),
            lambda: openai.AsyncOpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0).models.list(),
            lambda: client.chat.completions.create(model="gpt-4o", messages=messages),
        ):
            try:
                await bad()
            except openai.APIStatusError as exc:
                errors.append(type(exc).__name__)
        SEEN[api_key] = errors
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        return float(response.choices[0].finish_reason in ("stop", "length"))


async def sleeps(base_url, api_key, record):
    await asyncio.sleep(3600)


async def paced_turns(base_url, api_key, record):
    """three_turns with a second of the agent's own work (a tool, say) after each turn: a fault is likely to
    find its episodes between turns, some recorded."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for turn in range(3):
            response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            await asyncio.sleep(1.0)
            messages += [response.choices[0].message, {"role": "user", "content": f"And {turn}?"}]
        return float(len(messages) == 7)


async def three_turns_or_hangs(base_url, api_key, record):
    """three_turns, but the agents of one prompt in three never answer."""
    if int(record.query_id.rsplit("-", 1)[-1]) % 3 == 0:
        await asyncio.sleep(3600)
    return await three_turns(base_url, api_key, record)


def _deep(levels: int):
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


# Requests that once stopped the rollout role (each a 503 and an exception that was not the agent's), as raw
# bodies: the SDK would refuse to encode the lone surrogate itself.
MALFORMED = [
    ("/completions", {"model": "policy", "prompt": [3000000000], "max_tokens": 2}),
    ("/completions", {"model": "policy", "prompt": [1, 5000], "max_tokens": 2}),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "hi \ud800"}]}),
    (
        "/chat/completions",
        {
            "model": "policy",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": {"x": _deep(900)}},
                        }
                    ],
                },
            ],
        },
    ),
]


async def malformed_for_one_prompt_in_four(base_url, api_key, record):
    """paced_turns, but the agents of one prompt in four send every malformed request above and, each
    refused with a 4xx as it must be, give up; were one served, the episode would end with a reward of 0."""
    if int(record.query_id.rsplit("-", 1)[-1]) % 4 != 1:
        return await paced_turns(base_url, api_key, record)
    statuses = []
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as http:
        for path, body in MALFORMED:
            response = await http.post(base_url + path, content=json.dumps(body).encode())
            statuses.append(response.status_code)
    if all(400 <= status < 500 for status in statuses):
        raise RuntimeError(f"the endpoint refused every request: {statuses}")
    return 0.0


def _three_turns_blocking(base_url, api_key, record):
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as client:
        messages = [{"role": "user", "content": record.prompt}]
        for turn in range(3):
            response = client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR], max_tokens=12
            )
            messages.append(response.choices[0].message)
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn)})
    return 1.0


def sync_three_turns(base_url, api_key, record):
    """A plain function with the SDK's blocking client, as sync frameworks are."""
    return _three_turns_blocking(base_url, api_key, record)


async def async_but_blocking(base_url, api_key, record):
    """An async function that makes blocking calls (LiteLLM's sync completion, a sync HTTP client inside)."""
    return _three_turns_blocking(base_url, api_key, record)
