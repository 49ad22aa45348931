"""An episode's transcript: its turns as the workflow or agent saw them, recorded as they happen (cheaply: the
objects it already has) and rendered, bounded, only for the groups a monitor.TranscriptLog keeps.

One line an episode: its step, prompt id, epoch, index in the group, reward (as the workflow or agent returned
it, before scaling), counts (EpisodeContext.stats) and turns. A chat turn (``ctx.chat``, an agent's chat
request) holds the ``messages`` new to it (all of them, ``continues`` false, when they do not extend the last
turn's messages and reply), the ``tools`` offered, the ``reply`` (content and tool calls, arguments as JSON text,
as the OpenAI API sends them) and the calls the model wrote that could not be read (``malformed_calls``, with
its whole ``text``). Any other turn (``ctx.generate``, an agent's completion) holds the ``prompt`` text new to it
and the sampled ``text``. Every turn: prompt_tokens, completion_tokens, finish, the weight ``version`` of its
first token (and ``last_version`` when an update came during it), ``replayed`` when a journal answered it.

Texts come from the model and the agent: each is cut at TEXT_CHARS, an episode's at EPISODE_CHARS in all, and
turns, messages and calls are bounded in number; what is cut says how much.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_hpc.monitor import TranscriptLog

TEXT_CHARS = 4000
EPISODE_CHARS = 200_000
MAX_TURNS = 64
MAX_MESSAGES = 32  # new to a turn: the last ones are kept
MAX_CALLS = 16  # of a message
MAX_TOOLS = 32  # names offered to a turn


@dataclass
class Recorded:
    """One turn as it happened; rendered only when its episode's group is kept."""

    context: list[int]  # the ids new to its context
    prompt_tokens: int
    completion_tokens: int
    finish: str
    versions: tuple[int, int] | None  # of its first and last sampled tokens
    text: str
    replayed: bool
    chat: tuple | None = None  # (messages, tools, reply, calls) of a chat turn


class Transcript:
    """The turns of one episode."""

    def __init__(self):
        self.turns: list[Recorded] = []
        self.cut_turns = 0
        self._last: Recorded | None = None

    def generated(self, context: list[int], prompt_tokens: int, turn, replayed: bool) -> None:
        """A turn of ``ctx.generate``: ``context`` the ids new to it, ``turn`` its gen.episode.Generation."""
        self._last = None
        if len(self.turns) >= MAX_TURNS:
            self.cut_turns += 1
            return
        versions = (turn.versions[0], turn.versions[-1]) if turn.versions else None
        self._last = Recorded(
            context, prompt_tokens, len(turn.ids), turn.finish, versions, turn.text, replayed
        )
        self.turns.append(self._last)

    def chatted(self, messages: list[dict], tools: Sequence[dict] | None, reply: dict, calls: list) -> None:
        """The turn just generated was a chat turn: its messages, the tools offered, the reply, the parsed
        calls (agent.ToolCall, malformed ones included)."""
        if self._last is not None:
            self._last.chat, self._last.context = (messages, tools, reply, calls), []  # messages say it all

    def version(self) -> int | None:
        """The weight version of the episode's first sampled token (None: it sampled none)."""
        return min((t.versions[0] for t in self.turns if t.versions), default=None)

    def render(self, tokenizer) -> dict:
        """The turns as JSON: {"turns": [...]}, with "cut_turns" when there were more than MAX_TURNS."""
        budget, before, turns = Budget(EPISODE_CHARS), None, []
        for turn in self.turns:
            out, before = _turn(turn, tokenizer, before, budget)
            turns.append(out)
        return {"turns": turns, **({"cut_turns": self.cut_turns} if self.cut_turns else {})}


def episode_line(ctx, step: int, reward) -> dict:
    """One episode of a kept group as its transcript's line (``ctx``: its gen.episode.EpisodeContext)."""
    line = {"step": step, "query_id": ctx.record.query_id, "epoch": ctx.epoch, "episode": ctx.index}
    if isinstance(reward, Sequence):
        line["reward"] = [float(r) for r in reward][:MAX_TURNS]
    else:  # None: the group was dropped (an agent failed, a turn ran out of time)
        line["reward"] = None if reward is None else float(reward)
    return {**line, "stats": ctx.stats(), **ctx.transcript.render(ctx.tokenizer)}


def keep_group(log: TranscriptLog, contexts: Sequence, rewards: Sequence) -> int | None:
    """Write the transcripts of a finished group's episodes (their contexts and rewards) when ``log`` keeps its
    step; the step, or None."""
    versions = [v for ctx in contexts if (v := ctx.transcript.version()) is not None]
    step = log.admit(min(versions, default=None))
    if step is not None:
        log.write(step, [episode_line(ctx, step, r) for ctx, r in zip(contexts, rewards, strict=True)])
    return step


class Budget:
    """The characters an episode's texts may still take."""

    def __init__(self, chars: int):
        self.left = chars

    def cut(self, text: Any) -> str:
        text = text if isinstance(text, str) else "" if text is None else str(text)
        keep = min(len(text), TEXT_CHARS, self.left)
        self.left -= keep
        return text if keep == len(text) else f"{text[:keep]}[cut: {len(text) - keep} more characters]"


def _turn(turn: Recorded, tokenizer, before: list | None, budget: Budget) -> tuple[dict, list | None]:
    """A turn as JSON, and the conversation so far (``before``: the last chat turn's messages and reply)."""
    if turn.chat is None:
        out = {"prompt": budget.cut(tokenizer.decode(turn.context, skip_special_tokens=False))}
        out["text"] = budget.cut(turn.text)
    else:
        out, before = _chat(*turn.chat, turn.text, before, budget)
    out |= {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens}
    out["finish"] = turn.finish
    if turn.versions:
        first, last = turn.versions
        out |= {"version": first, **({"last_version": last} if last != first else {})}
    return out | ({"replayed": True} if turn.replayed else {}), before


def _chat(messages: list, tools, reply: dict, calls: list, text: str, before: list | None, budget: Budget):
    """A chat turn's messages new since ``before`` (all of them when they do not extend it), the tools offered,
    the reply, the calls that could not be read; and the conversation it leaves."""
    continues = before is not None and messages[: len(before)] == before
    new = messages[len(before) :] if continues else messages
    out: dict = {"continues": continues}
    if len(new) > MAX_MESSAGES:
        out["cut_messages"] = len(new) - MAX_MESSAGES
    out["messages"] = [_message(m, budget) for m in new[-MAX_MESSAGES:]]
    if tools:
        out["tools"] = [budget.cut(_name_of(t)) for t in tools[:MAX_TOOLS]]
    out["reply"] = _message(reply, budget)
    if malformed := [c.error for c in calls if c.error is not None][:MAX_CALLS]:
        out |= {"malformed_calls": [budget.cut(e) for e in malformed], "text": budget.cut(text)}
    return out, [*messages, reply]


def _message(message: Any, budget: Budget) -> dict:
    """A message as the OpenAI API carries it (tool call arguments as JSON text), its texts cut."""
    if not isinstance(message, dict):
        return {"content": budget.cut(message)}
    out = {"role": budget.cut(message.get("role")), "content": budget.cut(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = budget.cut(message[key])
    if isinstance(calls := message.get("tool_calls"), list) and calls:
        out["tool_calls"] = [_call(c, budget) for c in calls[:MAX_CALLS]]
    return out


def _call(call: Any, budget: Budget) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False, default=str)
    cid = budget.cut(call.get("id") if isinstance(call, dict) else None)
    named = {"name": budget.cut(function.get("name")), "arguments": budget.cut(arguments)}
    return {"id": cid, "type": "function", "function": named}


def _name_of(tool: Any) -> Any:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else tool
