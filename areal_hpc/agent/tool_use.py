"""An agent's tool use as the endpoint sees it (the agent runs its tools itself), counted into its episode's
counts beside the tools a workflow runs (gen.episode):

    tool_calls, tool_calls/<name>      every call the model wrote in a reply (a malformed one has no name)
    tool_errors                        calls the agent cannot run: malformed (the endpoint could not read them,
                                       so the agent never got them) or naming a tool the request did not offer
    tool_results, tool_results/<name>  the tool messages the agent sent back answering the model's last reply,
                                       each counted once

A result is not judged: whether the tool failed in the agent's hands is the agent's to know. Only a name the
request offered, of OpenAI's form, gets counts of its own, and an episode at most MAX_NAMES of them: what the
model invents cannot grow the statistics.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from areal_hpc.agent.tools import ToolCall

KINDS = ("tool_calls", "tool_results")  # the counts kept per name
MAX_NAMES = 16
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names


def count_by_name(counts: Counter, kind: str, name: str | None) -> None:
    """One more ``kind`` (of KINDS) of tool ``name``, while the episode counts at most MAX_NAMES names."""
    key = f"{kind}/{name}"
    if key not in counts and (name is None or not NAME.fullmatch(name) or len(names(counts)) >= MAX_NAMES):
        return
    counts[key] += 1


def names(counts: Counter) -> set[str]:
    """The tool names ``counts`` holds counts of."""
    return {key.partition("/")[2] for key in counts if key.partition("/")[0] in KINDS}


class ToolUse:
    """One episode's tool use through the endpoint; ``counts``: the episode's."""

    def __init__(self, counts: Counter):
        self.counts = counts
        self.waiting: dict[str, str | None] = {}  # the last reply's calls: id -> the name, if offered

    def answered(self, messages: Sequence[dict]) -> list[str | None]:
        """The names of the waiting calls that a request's ``messages`` answer: its tool messages after its last
        assistant message (the reply they answer), each call once."""
        ids = []
        for message in reversed(messages):
            if message["role"] == "assistant":
                break
            if message["role"] == "tool":
                ids.append(message["tool_call_id"])
        return [self.waiting[i] for i in dict.fromkeys(reversed(ids)) if i in self.waiting]

    def served(
        self, answered: list[str | None], calls: Sequence[ToolCall], tools: Sequence[dict] | None
    ) -> None:
        """Count a chat turn served: the results its request gave (``answered``), the calls of its reply
        (``calls``, malformed ones too) to the ``tools`` its request offered."""
        for name in answered:
            self.counts["tool_results"] += 1
            count_by_name(self.counts, "tool_results", name)
        offered = {tool["function"]["name"] for tool in tools or ()}
        self.waiting = {}
        for call in calls:
            usable = call.error is None and call.name in offered
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += not usable
            if call.error is None:
                self.waiting[call.id] = call.name if usable else None
                count_by_name(self.counts, "tool_calls", call.name if usable else None)


def tool_stats(counts: Counter, episodes: int) -> dict[str, float]:
    """The statistics of the counts above that the per-episode ones lack: rollout/tool_results_per_episode and,
    per tool name, rollout/tool_calls_per_episode/<name> and rollout/tool_results_per_episode/<name>."""
    episodes = max(episodes, 1)
    stats = {"rollout/tool_results_per_episode": counts["tool_results"] / episodes}
    for key, n in sorted(counts.items()):
        kind, _, name = key.partition("/")
        if kind in KINDS and name:
            stats[f"rollout/{kind}_per_episode/{name}"] = n / episodes
    return stats
