"""Agents: what one episode of a multi-turn, tool-using rollout is (docs/agents.md).

chat        incremental chat rendering: a new message's tokens appended to the ids already sampled
trajectory  the tokens of an episode with their loss mask, behaviour logprobs and weight versions; export
tools       tool calls in the chat template's format, and the tools (calculator, python in the sandbox)
tool_use    an agent's tool use as the endpoint sees it (calls, results, errors, per tool name)
bounds      nesting and text of JSON from outside (agents' requests, the policy's tool calls), bounded
programs    where an agent program runs: its namespaces, its uid, its environment (program_init.py their init)
workflows   the built-in workflows: single_turn and tool_loop
"""

from areal_hpc.agent.chat import ChatRenderer, ChatTemplateError, drifts
from areal_hpc.agent.programs import AgentError, AgentIsolationError, ProgramJail, program_env
from areal_hpc.agent.tool_use import ToolUse, count_by_name, tool_stats
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
    "AgentError",
    "AgentIsolationError",
    "ChatRenderer",
    "ChatTemplateError",
    "Sample",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolUse",
    "Toolbox",
    "ProgramJail",
    "Trajectory",
    "Turn",
    "content_of",
    "count_by_name",
    "drifts",
    "export",
    "load_tools",
    "parse_tool_calls",
    "program_env",
    "to_openai",
    "tool_stats",
]
