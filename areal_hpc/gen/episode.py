"""The episode context a workflow runs with: generation on the run's servers, chat, tools, the task's reward.

A workflow is `async def workflow(ctx, record) -> reward` (docs/agents.md). Everything it samples goes through
`ctx.generate` (token in, token out) or `ctx.chat` (messages in, the assistant's reply out), and the context
records it in a trajectory (agent.trajectory): context ids with loss mask 0, sampled ids with their behaviour
logprobs and the weight version of each. A generation on ids that extend the trajectory continues it; any other
starts a new trajectory of the episode (a "break", counted), as AReaL's individual export does. Where the run
keeps transcripts (Services.transcripts), it also records each turn as its caller saw it (gen.transcript).

Requests are blocking HTTP calls (gen.client), run in threads so that the episodes of a group (and their tool
calls) proceed side by side. A generation interrupted by a weight update is continued with the tokens it has
(gen.partial), each token tagged with the version it was sampled under. Under routing replay a turn keeps the
routed experts of its last request (gen.routing), in the trajectory and in the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import numpy as np

from areal_hpc.agent import (
    ChatRenderer,
    Toolbox,
    ToolCall,
    Trajectory,
    content_of,
    count_by_name,
    drifts,
    parse_tool_calls,
    to_openai,
)
from areal_hpc.gen.journal import Entry, Journal, Journals, request_key
from areal_hpc.gen.partial import PartialAnswer, answers_of, cache_counts, finish
from areal_hpc.gen.transcript import Transcript
from areal_hpc.monitor import TranscriptLog


class EpisodeCancelled(RuntimeError):
    """The episode was given up (its time ran out, or the role stops) while it generated."""


class InvalidRequest(ValueError):
    """A turn asked with what no server can take (ids outside the vocabulary, messages the chat template cannot
    render): the asker's mistake (the endpoint answers it with 400, the agent's), never the servers'."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


@dataclass(frozen=True)
class Generation:
    """One model turn: the sampled ids, their behaviour logprobs and weight versions, why it ended, its text."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # stop | length
    text: str
    # Routing replay: the routed experts of its request's ids and of the sampled ids but the last (gen.routing)
    routing: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass
class Services:
    """What every episode of a rollout process shares."""

    tokenizer: Any
    options: Any  # config.RolloutConfig: what the workflows read (max_turns, ...)
    score: Callable[[str, Any, Sequence[int]], float]  # (answer text, record, answer ids) -> task reward
    toolbox: Toolbox | None = None
    version_now: Callable[[], int] | None = None  # None: interruptible (the server tags each part)
    stop: threading.Event | None = None  # the role stops: requests waiting for admission give up
    # Prompt + new tokens a server takes as configured (episodes.max_context); an episode's own server bounds it
    # further where it reports its context (EpisodeContext.max_context). None: no bound configured.
    max_context: int | None = None
    vocab_size: int | None = None  # the model's token ids are below it (None: the tokenizer's length)
    journals: Journals | None = None  # where episodes record their generations (None: nowhere, no resume)
    transcripts: TranscriptLog | None = None  # where a sample of them is kept (None: nowhere, none recorded)


class EpisodeContext:
    """One episode: index ``index`` of its prompt's group in ``epoch``, generating on ``client`` with
    ``params``; ``journal`` records its generations (and answers them again after a restart)."""

    def __init__(
        self,
        services: Services,
        client,
        record,
        params: dict,
        index: int,
        journal: Journal | None = None,
        epoch: int = 0,
    ):
        self.services, self.client, self.record = services, client, record
        self.index, self.epoch = index, epoch
        self.journal = journal  # its completed generations, replayed after a restart (gen.journal)
        self.tokenizer, self.options = services.tokenizer, services.options
        self.last_turn: Generation | None = None
        self.params = {**params, "n": 1}
        # The server's context where it reports one (a larger request is a 400 there), within the configured.
        self.max_context = min(filter(None, (services.max_context, client.context_length())), default=None)
        self.trajectories: list[Trajectory] = []
        # turns, interrupted_turns, breaks, drifted_turns, tool_*, and the prefix cache's (partial.CACHE_COUNTS)
        self.counts: Counter[str] = Counter()
        self.tool_secs = 0.0
        self.session: dict = {}  # the tools' state in this episode (the python tool's earlier cells)
        self._cancel = threading.Event()
        self._running: set[str] = set()  # ids of the requests in flight, aborted on cancel
        self._renderers: dict[str, ChatRenderer] = {}
        # The conversation the trajectory holds (its messages and replies) and the renderer that rendered it.
        self._chat: tuple[ChatRenderer, list[dict]] | None = None
        self._calls: list = []  # the tool calls of the last reply
        # The model's calls so far: each gets an id of its own in the episode, as OpenAI's do.
        self._n_calls = 0
        # Why a call of the episode's agent failed when the agent is not to blame (set by gen.endpoint).
        self.failure: Exception | None = None
        self.transcript = Transcript() if services.transcripts else None  # its turns as the caller saw them

    # --- token in, token out ------------------------------------------------------------------------------

    async def generate(
        self, ids: Sequence[int], sampling: dict | None = None, stop: Sequence[str] = ()
    ) -> Generation:
        """Sample a turn after ``ids``: ``sampling`` overrides the run's sampling params (ppo.gen); the turn ends
        at the first of the ``stop`` strings (its tokens up to the one that completes it are kept; its text ends
        before it). A turn recorded in the episode's journal before a restart is answered from there."""
        ids = self._checked(ids)
        traj = self.trajectories[-1] if self.trajectories else None
        if traj is None or not traj.extends(ids):
            self.counts["breaks"] += traj is not None
            traj = Trajectory(routing_per_turn=self.options.export == "per_turn")
            self.trajectories.append(traj)
        context = ids[len(traj.ids) :]
        traj.add_context(context)
        params = self._turn_params(sampling)
        limit = self.max_context
        room = limit - len(ids) - 1 if limit else params["max_new_tokens"]
        if room < 1:  # the conversation fills the servers' context: the episode can only end here
            self.counts["context_full"] += 1
            self.last_turn = Generation([], [], [], "length", "")
            self._transcribe(context, len(ids), False)
            return self.last_turn
        params["max_new_tokens"] = min(params["max_new_tokens"], room)
        key = request_key(ids, params, stop)
        replayed = (entry := self.journal.replay(key) if self.journal else None) is not None
        if replayed:
            turn = Generation(entry.ids, entry.logprobs, entry.versions, entry.finish, "", entry.routing)
            self.counts["replayed_turns"] += 1
        else:
            turn = await self._live(ids, params, stop)
            if self.journal:
                entry = Entry(key, turn.ids, turn.logprobs, turn.versions, turn.finish, turn.routing)
                self.journal.append(entry)
        traj.add_turn(turn.ids, turn.logprobs, turn.versions, turn.finish, turn.routing)
        self.counts["turns"] += 1
        self.counts["drifted_turns"] += drifts(self.tokenizer, turn.ids)
        text = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
        self.last_turn = replace(turn, text=cut_text(text, stop))
        self._transcribe(context, len(ids), replayed)
        return self.last_turn

    def _transcribe(self, context: list[int], prompt_tokens: int, replayed: bool) -> None:
        if self.transcript is not None:
            self.transcript.generated(context, prompt_tokens, self.last_turn, replayed)

    def _checked(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list, each a token of the model's vocabulary (InvalidRequest names the first that is not)."""
        vocab = self.services.vocab_size or len(self.tokenizer)
        array = np.asarray(ids) if len(ids) else np.zeros(0, np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InvalidRequest("prompt", "must be a list of integer token ids")
        if len(outside := np.flatnonzero((array < 0) | (array >= vocab))):
            at = int(outside[0])
            raise InvalidRequest(
                f"prompt[{at}]", f"token id {array[at]} is not in the vocabulary [0, {vocab})"
            )
        return array.tolist()

    async def _live(self, ids: list[int], params: dict, stop: Sequence[str]) -> Generation:
        answer = await asyncio.to_thread(self._sample, ids, params)
        self.counts["interrupted_turns"] += answer.n_parts > 1
        self.counts.update(cache_counts([answer]))  # its requests (a replayed turn sent none)
        out, logprobs = list(answer.output_ids), list(answer.logprobs)
        versions = [v for part in answer.parts for v in [part.first] * part.tokens]
        ended, routing = "stop" if answer.finish == "stop" else "length", answer.routing
        if stop and (k := stop_length(self.tokenizer, out, stop)) is not None:
            out, logprobs, versions, ended = out[:k], logprobs[:k], versions[:k], "stop"
            routing = None if routing is None else routing[: len(ids) + k]  # the rows of the ids kept
        return Generation(out, logprobs, versions, ended, "", routing)

    def _turn_params(self, sampling: dict | None) -> dict:
        params = {**self.params, **(sampling or {}), "n": 1}
        if params.get("sampling_seed") is not None:  # each episode and turn a stream of its own
            seed = params["sampling_seed"] + 1009 * self.index + 7919 * self.counts["turns"]
            params["sampling_seed"] = seed % 2**31
        return params

    def _sample(self, ids: list[int], params: dict) -> PartialAnswer:
        """One answer, continued after interruptions (a thread of its own)."""
        min_version = self.services.version_now() if self.services.version_now else None

        def ask(prompt: list[int], p: dict) -> list[PartialAnswer]:
            rid = f"ep-{uuid.uuid4().hex}"
            self._running.add(rid)  # before the check: a cancel after it aborts this request
            try:
                if self._cancel.is_set():
                    raise EpisodeCancelled("the episode was given up")
                responses = self.client.generate([prompt], p, rid=rid, stop=self.services.stop)
            finally:
                self._running.discard(rid)
            return answers_of(self.client, responses, prompt, p, min_version)

        (answer,) = ask(ids, params)
        return finish(ask, ids, params, 0, answer, max_parts=1000)

    def cancel(self) -> None:
        """Give the episode up: no new request is sent, those in flight are aborted (they answer at once)."""
        self._cancel.set()
        for rid in list(self._running):
            with contextlib.suppress(
                Exception
            ):  # it ended meanwhile, or the server is gone: nothing to abort
                self.client.abort_request(rid)

    # --- chat ---------------------------------------------------------------------------------------------

    async def chat(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        sampling: dict | None = None,
        stop: Sequence[str] = (),
        parse_tools: bool = True,
        parallel_tool_calls: bool = True,
        force_call: bool = False,
        call_name: str | None = None,
    ) -> dict:
        """The assistant's reply to ``messages`` (OpenAI-style dicts; ``tools``: function schemas), its tool calls
        parsed into ``tool_calls`` (``parse_tools`` false: the whole text is the content; ``parallel_tool_calls``
        false: the first call only, the others counted as ``cut_tool_calls``; the sampled ids keep them all).
        ``force_call``: the turn opens a tool call (of ``call_name`` when given) whatever the model would have
        done: the template's opening of a call is appended to the context as tokens the model did not sample
        (never trained, counted as ``forced_turns``), and the model writes the rest.
        When ``messages`` extend the conversation so far (earlier messages and replies, unchanged), only the new
        messages' tokens are appended to the sampled ids. ``sampling`` and ``stop``: as for generate."""
        messages = list(messages)
        renderer, ids = self._render(messages, tools)
        opening = renderer.call_opening(call_name) if force_call else ""
        turn = await self.generate(ids + renderer.encode(opening), sampling, stop)
        self.counts["forced_turns"] += force_call
        self.counts["constrained_turns"] += "json_schema" in (sampling or {})
        text = opening + turn.text
        calls = parse_tool_calls(text) if parse_tools else []
        # ids unique in the episode (frameworks tell calls apart by id: the Agents SDK drops a repeated one)
        self._calls = [dataclasses.replace(c, id=f"call_{self._n_calls + i}") for i, c in enumerate(calls)]
        self._n_calls += len(calls)
        if not parallel_tool_calls and len(self._calls) > 1:
            self.counts["cut_tool_calls"] += len(self._calls) - 1
            self._calls = self._calls[:1]
        reply: dict = {"role": "assistant", "content": content_of(text) if parse_tools else text}
        if calls := to_openai(self._calls):
            reply["tool_calls"] = calls
        self._chat = (renderer, [*messages, reply])
        if self.transcript is not None:
            self.transcript.chatted(messages, tools, reply, self._calls)
        return reply

    def _render(self, messages: list[dict], tools: Sequence[dict] | None) -> tuple[ChatRenderer, list[int]]:
        """The ids of a chat turn's context: the trajectory and the new messages' tokens when ``messages`` extend
        the conversation, else their first rendering. What the template cannot render is InvalidRequest."""
        try:
            renderer = self._renderer(tools)
            traj = self.trajectories[-1] if self.trajectories else None
            if self._continues(renderer, messages) and traj is not None and traj.turns:
                last = traj.turns[-1]
                new = messages[len(self._chat[1]) :]
                return renderer, traj.ids + renderer.after_turn(new, traj.ids[last.start : last.end])
            return renderer, renderer.first(messages)
        except (ValueError, TypeError, LookupError, RecursionError, jinja2.TemplateError) as exc:
            # ChatTemplateError is a ValueError; a message the template did not expect fails in many ways
            raise InvalidRequest("messages", f"the chat template cannot render them: {exc}") from exc

    def _continues(self, renderer: ChatRenderer, messages: list[dict]) -> bool:
        if self._chat is None or self._chat[0] is not renderer:
            return False
        before = self._chat[1]
        return len(messages) > len(before) and messages[: len(before)] == before

    def _renderer(self, tools: Sequence[dict] | None) -> ChatRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools)
        return self._renderers[key]

    # --- tools and reward ---------------------------------------------------------------------------------

    @property
    def tool_schemas(self) -> list[dict]:
        """The function schemas of the run's tools (rollout.tools), for ``chat(messages, tools=...)``."""
        return self.services.toolbox.schemas() if self.services.toolbox else []

    @property
    def pending_calls(self) -> list:
        """The tool calls of the last reply, malformed ones included (agent.ToolCall)."""
        return list(self._calls)

    async def run_tools(self) -> list[dict]:
        """Run the last reply's tool calls, in order (a call may see an earlier one's state); their answers as tool
        messages. A malformed call or a failing tool is answered with an error message (counted), never raised."""
        toolbox = self.services.toolbox
        if toolbox is None:
            raise RuntimeError("this run offers no tools (rollout.tools is empty)")
        calls, self._calls = self._calls, []
        messages = []
        for call in calls:
            result = await asyncio.to_thread(toolbox.run, call, self.session)
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += result.error
            count_by_name(self.counts, "tool_calls", call.name if call.name in toolbox.tools else None)
            self.tool_secs += result.secs
            messages.append(
                {
                    "role": "tool",
                    "name": call.name or "error",
                    "tool_call_id": call.id,
                    "content": result.text,
                }
            )
        return messages

    async def call_tool(self, name: str, arguments: dict) -> dict:
        """Run a tool the workflow calls itself (not the model): its answer as a tool message, counted as a
        model's call is."""
        self._calls = [ToolCall(name, arguments, None, f"call_{self.counts['tool_calls']}")]
        (message,) = await self.run_tools()
        return message

    async def score(self, text: str, ids: Sequence[int] = ()) -> float:
        """The task reward of an answer to this episode's record, by its task (math, code, stem) or reward.fn."""
        return await asyncio.to_thread(self.services.score, text, self.record, ids)

    # --- what the episode leaves ------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        tokens = sum(len(t.ids) for t in self.trajectories)
        sampled = sum(t.n_sampled for t in self.trajectories)
        mismatched = int(bool(self.journal and self.journal.mismatched))
        counts = {"tool_secs": self.tool_secs, "tokens": tokens, "sampled_tokens": sampled}
        return {**self.counts, **counts, "replay_mismatches": mismatched}


def stop_length(tokenizer, ids: list[int], stop: Sequence[str]) -> int | None:
    """The fewest of ``ids`` whose text holds one of the ``stop`` strings (None: none does)."""

    def holds(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return any(s and s in text for s in stop)

    if not holds(len(ids)):
        return None
    low, high = 1, len(ids)  # holds(high); find the least such k
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return low


def cut_text(text: str, stop: Sequence[str]) -> str:
    """The text before the first of the ``stop`` strings it holds (as OpenAI's API returns it)."""
    hits = [i for s in stop if s and (i := text.find(s)) >= 0]
    return text[: min(hits)] if hits else text
