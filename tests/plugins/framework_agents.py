"""Agents written with popular frameworks as their users write them, each with a calculator tool: the OpenAI
Agents SDK (its default Responses model, and its chat-completions model forcing tool use one call at a time) and
LangChain's ChatOpenAI with tools bound as `bind_tools(tool_choice="any", parallel_tool_calls=False)` asks.
Each knows nothing of areal_hpc but the base URL, the key and the record it is given."""

from __future__ import annotations

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

from areal_hpc.agent.toy_agent import CALCULATOR, calculate

set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * and parentheses."""
    return calculate(expression)


async def agents_sdk_default(base_url, api_key, record):
    """The Agents SDK's default model: OpenAI's Responses API."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="solver", instructions="Use the calculator.", tools=[calculator],
                  model=OpenAIResponsesModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=256))  # fmt: skip
    result = await Runner.run(agent, record.prompt, max_turns=3)
    return float("1786" in str(result.final_output))


async def agents_sdk_forced(base_url, api_key, record):
    """The Agents SDK on chat completions, tool use required, one call at a time: its first turn must call."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    settings = ModelSettings(max_tokens=256, tool_choice="required", parallel_tool_calls=False)
    agent = Agent(name="solver", tools=[calculator], model_settings=settings, reset_tool_choice=True,
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))  # fmt: skip
    result = await Runner.run(agent, record.prompt, max_turns=3)
    return float("1786" in str(result.final_output))


async def langchain_any_tool(base_url, api_key, record):
    """LangChain's ChatOpenAI, a tool call required of the first turn, one call at a time; three turns."""
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, max_tokens=256)
    forced = llm.bind_tools([CALCULATOR], tool_choice="any", parallel_tool_calls=False)
    free = llm.bind_tools([CALCULATOR], parallel_tool_calls=False)
    messages = [HumanMessage(record.prompt)]
    for turn in range(3):
        reply = await (forced if turn == 0 else free).ainvoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(
                ToolMessage(calculate(str(call["args"].get("expression"))), tool_call_id=call["id"])
            )
        if turn < 2 and not reply.tool_calls:
            messages.append(HumanMessage("Go on."))
    return float("1786" in str(reply.content))
