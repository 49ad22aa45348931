"""`areal-hpc episodes`: the transcripts of a run's episodes (monitor.transcripts), printed for a reader or as
the JSON lines they are stored as. The texts are the model's and the agents': printed, their control characters
are escaped, so that none reaches the terminal."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from areal_hpc.control import RunDir
from areal_hpc.monitor.transcripts import read_transcripts, transcript_steps

COUNTS = ("turns", "tool_calls", "tool_results", "tool_errors", "breaks", "refused_requests")  # in the header


def show_episodes(
    run: RunDir,
    step: int | None = None,
    prompt: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """Print the episodes of ``step`` (default: the newest with transcripts), only ``prompt``'s if given, to
    ``out`` (default: stdout); the exit code (1: none)."""
    out = out or sys.stdout
    steps = transcript_steps(run)
    if not steps:
        print(f"no transcripts in {run.transcripts} (rollout.transcript_groups keeps a few groups of each step "
              "of multi-turn workflows and agents)", file=sys.stderr)  # fmt: skip
        return 1
    step = steps[-1] if step is None else step
    episodes = [e for e in read_transcripts(run, step) if prompt is None or e.get("query_id") == prompt]
    if not episodes:
        which = f" of prompt {prompt!r}" if prompt is not None else ""
        print(f"no episodes{which} in step {step}; steps with transcripts: {_spans(steps)}", file=sys.stderr)
        return 1
    for episode in episodes:
        out.write((json.dumps(episode) if as_json else format_episode(episode)) + "\n")
    return 0


def format_episode(episode: dict) -> str:
    """An episode as a reader reads it: a header with its counts, then each turn's messages and reply."""
    lines, offered = _header(episode), None
    for i, turn in enumerate(episode.get("turns") or []):
        if i and turn.get("continues") is False:
            lines.append("--- a new conversation: these messages do not extend the last turn's")
        if "reply" not in turn:
            lines += _generation(turn)
            continue
        if turn.get("tools") and turn["tools"] != offered:  # said again only when they change
            lines.append(f"(tools offered: {', '.join(map(_safe, turn['tools']))})")
        offered = turn.get("tools")
        lines += _chat_turn(turn)
    if episode.get("cut_turns"):
        lines.append(f"[{_safe(episode['cut_turns'])} more turns not kept]")
    return "\n".join(lines)


def _header(episode: dict) -> list[str]:
    """Which episode it is, its reward, its counts and each tool's."""
    lines = [f"=== step {_safe(episode.get('step'))} | prompt {_safe(episode.get('query_id'))} (epoch "
             f"{_safe(episode.get('epoch'))}) | episode {_safe(episode.get('episode'))} | reward "
             f"{_safe(episode.get('reward'))}"]  # fmt: skip
    stats = episode.get("stats") or {}
    if counts := [f"{name.replace('_', ' ')} {_safe(stats[name])}" for name in COUNTS if stats.get(name)]:
        lines.append(f"    {', '.join(counts)}")
    tools: dict[str, list[str]] = {}  # name -> "1 calls", "1 results"
    for key, n in stats.items():
        kind, _, name = key.partition("/")
        if name:
            tools.setdefault(name, []).append(f"{_safe(n)} {kind.removeprefix('tool_')}")
    if tools:
        lines.append("    " + "; ".join(f"{_safe(name)}: {', '.join(c)}" for name, c in tools.items()))
    return lines


def _chat_turn(turn: dict) -> list[str]:
    lines = [f"[{_safe(turn['cut_messages'])} earlier messages not kept]"] if turn.get("cut_messages") else []
    for message in turn.get("messages") or []:
        lines += _message(message)
    lines += _message(turn["reply"], _about(turn))
    lines += [
        f"  x a tool call that could not be read: {_safe(e)}" for e in turn.get("malformed_calls") or []
    ]
    if "text" in turn:
        lines += ["  the model's whole text:", *_indented(turn["text"], "    ")]
    return lines


def _generation(turn: dict) -> list[str]:
    """A turn on token ids or a completion: the text new to its context, then the sampled text."""
    return [
        "[prompt]",
        *_indented(turn.get("prompt")),
        f"[completion | {_about(turn)}]",
        *_indented(turn.get("text")),
    ]


def _message(message: dict, about: str = "") -> list[str]:
    tags = [message.get("role"), message.get("name"), message.get("tool_call_id"), about]
    lines = [f"[{' | '.join(_safe(t) for t in tags if t)}]"]
    lines += _indented(message["content"]) if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        lines.append(
            f"  -> {_safe(function.get('name'))}({_safe(function.get('arguments'))}) id {_safe(call.get('id'))}"
        )
    return lines


def _about(turn: dict) -> str:
    """A model turn's tokens, finish reason and weight versions."""
    version = turn.get("version")
    parts = [
        f"{_safe(turn.get('prompt_tokens'))} + {_safe(turn.get('completion_tokens'))} tokens",
        _safe(turn.get("finish")),
    ]
    if version is None:
        parts.append("no token sampled")
    else:
        parts.append(f"weights v{version}" + (f"-{turn['last_version']}" if "last_version" in turn else ""))
    return ", ".join(parts + (["replayed from the journal"] if turn.get("replayed") else []))


def _indented(text, prefix: str = "  ") -> list[str]:
    return [prefix + line for line in _safe(text).split("\n")]


def _safe(value) -> str:
    """``value`` as text, every control or format character but newline and tab escaped (\\x1b, \\u202e)."""
    text = value if isinstance(value, str) else "" if value is None else json.dumps(value)
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)


def _spans(steps: list[int]) -> str:
    """The steps as ranges: 1-4, 7, 9-10."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
