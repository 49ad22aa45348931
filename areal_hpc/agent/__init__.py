"""Agents: what one episode of a multi-turn, tool-using rollout is (docs/agents.md).

chat        incremental chat rendering: a new message's tokens appended to the ids already sampled
trajectory  the tokens of an episode with their loss mask, behaviour logprobs and weight versions; export
tools       tool calls in the chat template's format, and the tools (calculator, python in the sandbox)
workflows   the built-in workflows: single_turn and tool_loop
"""

from areal_hpc.agent.chat import ChatRenderer, ChatTemplateError, drifts
from areal_hpc.agent.tools import (
    Tool,
    Toolbox,
    ToolCall,
    ToolResult,
    content_of,
    load_tools,
    parse_tool_calls,
    to_openai,
)
from areal_hpc.agent.trajectory import Sample, Trajectory, Turn, export

__all__ = [
    "ChatRenderer",
    "ChatTemplateError",
    "Sample",
    "Tool",
    "ToolCall",
    "ToolResult",
    "Toolbox",
    "Trajectory",
    "Turn",
    "content_of",
    "drifts",
    "export",
    "load_tools",
    "parse_tool_calls",
    "to_openai",
]
