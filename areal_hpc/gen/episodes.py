"""A prompt's group of episodes: group_size runs of the workflow side by side, exported as training samples.

Every episode of a group runs on one server (its prefix cache serves them all) under one staleness slot: the
group is what the generation manager admits, as a single-turn group is. A group with an episode that does not
end within rollout.episode_timeout_secs is given up (its requests aborted) and dropped: the caller counts it and
records its prompt as used, and no wait of the run hangs on it. An agent's episode waits for its turn
(rollout.agent_concurrency) first; its time runs from its turn.

An agent that fails the same way on every group a step draws, or on the first batch of groups of an attempt of
asynchronous RL, would fail alike in a new attempt: RepeatedAgentError ends the run (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from transformers import AutoConfig

from areal_hpc.agent import AgentError, Sample, Toolbox, export, load_tools, tool_stats, workflows
from areal_hpc.config import ExperimentConfig, InputError, extensions, gen_backend
from areal_hpc.control import RunDir
from areal_hpc.data import write_batch
from areal_hpc.gen.agents import Slots, agent_slots, command_agent, function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episode import EpisodeContext, Services
from areal_hpc.gen.partial import CACHE_COUNTS, cache_stats
from areal_hpc.gen.rollout import (
    Group,
    StepRollout,
    draw_groups,
    dynamic_stats,
    group_params,
    pack_episodes,
    step_rollout,
)
from areal_hpc.gen.transcript import keep_group
from areal_hpc.recover import current_attempt

logger = logging.getLogger("rollout")
PER_EPISODE = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_secs",
    "breaks",
    "drifted_turns",
    "interrupted_turns",
    "context_full",
    "replayed_turns",
    "replay_mismatches",
    "refused_requests",  # an agent's requests the endpoint answered with a 4xx
    "cut_tool_calls",  # calls after a turn's first, not returned under parallel_tool_calls false
    "forced_turns",  # turns made to open a tool call (tool_choice required or a named function)
    "constrained_turns",  # turns sampled under a grammar (response_format): their logprobs are the grammar's
)
EPISODE_COUNTS = (*PER_EPISODE, "tokens", "sampled_tokens")  # what a group's file records of its episodes


def kept_count(name: str) -> bool:
    """Whether a group's file records its episodes' count ``name``: EPISODE_COUNTS, an agent's tool results
    and the per-tool-name counts (agent.tool_use)."""
    return name in EPISODE_COUNTS or name == "tool_results" or "/" in name


class GroupDropped(RuntimeError):
    """A group's episodes were given up; ``reason`` goes with its drop marker and its line in the ledger.
    ``cause``: the message without what differs from group to group, by which drops are counted."""

    reason = "dropped"

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause or message


class GroupTimeout(GroupDropped):
    """A group's episodes did not end in time."""

    reason = "timeout"


class AgentFailed(GroupDropped):
    """The user's agent failed an episode of the group (gen.agents)."""

    reason = "agent_error"


GIVEN_UP = (GroupTimeout.reason, AgentFailed.reason)  # the drops rollout/dropped_groups counts


class RepeatedAgentError(InputError):
    """The agent failed the same way on every group it was given: a new attempt would too, so the run ends
    without one (an InputError: the agent is an input the config names)."""


def repeats(drops: Sequence[tuple[str, int, GroupDropped]]) -> bool:
    """Whether every group of ``drops`` (query id, epoch, why) was dropped for the agent's error of one cause."""
    causes = {error.cause for _, _, error in drops}
    return bool(drops) and len(causes) == 1 and all(isinstance(e, AgentFailed) for _, _, e in drops)


def by_cause(drops: Sequence[tuple[str, int, GroupDropped]]) -> str:
    """The groups ``drops`` (query id, epoch, why), counted by cause, the most first, each with the first group
    it dropped (and that group's message where it says more): `4 by rollout.agent returned None, not a number
    (the reward) (first at prompt 'q1', epoch 0)`. The cause stays on top of what followed from it."""
    causes: dict[str, list] = {}
    for drop in drops:
        causes.setdefault(drop[2].cause, []).append(drop)
    parts = []
    for cause, same in sorted(causes.items(), key=lambda item: -len(item[1])):
        query_id, epoch, error = same[0]
        more = f": {error}" if str(error) != cause else ""
        parts.append(f"{len(same)} by {cause} (first at prompt {query_id!r}, epoch {epoch}{more})")
    return "; ".join(parts)


class FirstGroups:
    """Asynchronous RL's test of an agent that never works: when the first ``n`` groups (a batch) of this attempt
    to end were all dropped for the agent's error of one cause, RepeatedAgentError. Any other end among them (a
    group kept or filtered, or given up otherwise) passes the test for good: the agent works on some prompts, or
    the drops have another cause, and the run goes on (dropping those groups) as before."""

    def __init__(self, n: int):
        self.n, self.drops, self.decided = n, [], False
        self._lock = threading.Lock()

    def ended(self, query_id: str, epoch: int, dropped: GroupDropped | None = None) -> None:
        """A group ended: kept or filtered, or given up (``dropped``)."""
        with self._lock:
            if self.decided:
                return
            if dropped is not None:
                self.drops.append((query_id, epoch, dropped))
            alike = dropped is not None and repeats(self.drops)
            self.decided = not alike or len(self.drops) == self.n
            if not (alike and self.decided):
                return
        raise RepeatedAgentError(
            f"the first {self.n} groups of this attempt were all dropped: {by_cause(self.drops)}: the agent has "
            "not worked once, and a new attempt would fail alike"
        )


@dataclass
class GroupResult:
    samples: list[list[Sample]]  # each episode's
    rewards: list[float]  # each episode's task reward (the mean of its turns' when given per turn)
    counts: Counter = field(default_factory=Counter)  # summed over the episodes (EPISODE_COUNTS)
    secs: float = 0.0


def is_single_turn(cfg: ExperimentConfig) -> bool:
    """The built-in single_turn runs as one request of group_size answers (gen.rollout), as before workflows."""
    if cfg.rollout.agent or cfg.rollout.agent_command:
        return False
    return extensions.load("rollout.workflow", cfg.rollout.workflow) is workflows.single_turn


def make_services(cfg: ExperimentConfig, tokenizer, rewards, **kwargs) -> Services:
    """The services of a rollout process's episodes: its tokenizer, the task rewards (reward.TaskRewards), the
    run's tools; ``kwargs``: Services' version_now and stop."""
    r = cfg.rollout
    toolbox = Toolbox(
        load_tools(r.tools), time_secs=r.tool_time_secs, output_chars=r.max_tool_output_chars,
        python_state=r.python_state, memory_mb=cfg.reward.code_memory_mb, isolation=cfg.reward.code_isolation,
    ) if r.tools else None  # fmt: skip

    def score(text: str, record, ids) -> float:
        return rewards.score_batch([(text, record, tuple(ids))])[0]

    model = AutoConfig.from_pretrained(cfg.actor.path)
    return Services(tokenizer, r, score, toolbox, max_context=max_context(cfg, model),
                    vocab_size=model.vocab_size, **kwargs)  # fmt: skip


def max_context(cfg: ExperimentConfig, model) -> int:
    """The tokens (prompt and answer) a generation server takes as configured: sglang.context_length, which
    both backends are launched with, else the model's own (``model``'s max_position_embeddings); the built-in
    server takes no more than the model's. A server that reports its own (/server_info's context_length: the
    built-in server's is bounded by its KV cache too) bounds its episodes by that (EpisodeContext)."""
    model_len = model.max_position_embeddings
    configured = cfg.sglang.context_length or model_len
    return configured if gen_backend(cfg) == "sglang" else min(configured, model_len)


class Episodes:
    """The groups of a rollout process: its workflow (rollout.workflow) over its services."""

    def __init__(self, cfg: ExperimentConfig, services: Services, run: RunDir | None = None):
        """``run``: where rollout.agent_command's output goes (its agent_logs), and what its program must not see
        (the run directory, its secret)."""
        self.cfg, self.services = cfg, services
        r = cfg.rollout
        agent = bool(r.agent or r.agent_command)
        self.endpoint = Endpoint(r.agent_model) if agent else None
        self.slots = agent_slots(r.agent_concurrency, programs=bool(r.agent_command)) if agent else None
        if r.agent:
            self.workflow = function_agent(extensions.load("rollout.agent", r.agent), self.endpoint)
        elif r.agent_command:
            self.workflow = command_agent(r.agent_command, self.endpoint, run.agent_logs, r.agent_output_bytes,
                                          env_names=r.agent_env, hidden=[run.root], isolation=r.agent_isolation,
                                          attempt=current_attempt())  # fmt: skip
        else:
            self.workflow = extensions.load("rollout.workflow", r.workflow)

    def finished(self, record, epoch: int) -> None:
        """The group of ``record`` in ``epoch`` is stored or dropped: its journals go."""
        if self.services.journals:
            self.services.journals.remove_group(epoch, record.query_id)

    def close(self) -> None:
        if self.endpoint:
            self.endpoint.shutdown()

    def group(self, client, record, epoch: int) -> GroupResult:
        params = group_params(self.cfg, record.query_id, epoch)
        timeout, size = self.cfg.rollout.episode_timeout_secs, self.cfg.group_size
        return run_group(
            self.services, self.workflow, client, record, params, size, timeout, epoch, self.slots
        )


def run_group(
    services: Services,
    workflow: Callable,
    client,
    record,
    params: dict,
    group_size: int,
    timeout: float,
    epoch: int = 0,
    slots: Slots | None = None,
) -> GroupResult:
    """Run the group's episodes (a new event loop in the calling thread), each in its turn of ``slots`` (all at
    once without); GroupTimeout when one runs past ``timeout`` from its turn. With journals, an episode the
    prompt of ``epoch`` ran before a restart resumes at its last recorded turn."""
    start = time.monotonic()
    journals = services.journals
    contexts = [
        EpisodeContext(
            services,
            client,
            record,
            params,
            i,
            journals.episode(epoch, record.query_id, i) if journals else None,
            epoch,
        )
        for i in range(group_size)
    ]
    try:
        rewards = asyncio.run(_episodes(workflow, contexts, record, timeout, slots))
    except Exception:
        if services.transcripts:  # a failing agent's episodes are the ones its user wants to read
            keep_group(services.transcripts, contexts, [None] * group_size)
        raise
    if services.transcripts:
        keep_group(services.transcripts, contexts, rewards)
    options = services.options
    result = GroupResult([], [], secs=time.monotonic() - start)
    for ctx, reward in zip(contexts, rewards, strict=True):
        samples = [
            s for t in ctx.trajectories for s in export(t, reward, options.export, options.turn_discount)
        ]
        result.samples.append(samples)
        result.rewards.append(float(np.mean(reward)) if isinstance(reward, Sequence) else float(reward))
        result.counts.update(ctx.stats())
    return result


class _OutOfTime(Exception):
    """An episode ran past its time."""


async def _episodes(
    workflow: Callable, contexts: list[EpisodeContext], record, timeout: float, slots: Slots | None
) -> list:
    # Each episode waits on one blocking call at a time (a request, a tool): a thread each, and as many again
    # for workflows that gather calls. asyncio's default pool (CPUs + 4) would queue a group's turns.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2 * len(contexts)))
    tasks = [asyncio.ensure_future(_episode(workflow, ctx, record, timeout, slots)) for ctx in contexts]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
    if errors or pending:  # an episode failed or ran out of time: it and the others are given up
        for ctx in contexts:
            # Aborts their requests, so that their threads end now; a timed-out episode's thread runs on even
            # when no task is pending (every episode out of time at once), and asyncio.run would wait for it.
            ctx.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed := [e for e in errors if isinstance(e, AgentError)]:
        raise AgentFailed(str(failed[0]), failed[0].cause) from failed[0]
    if bugs := [e for e in errors if not isinstance(e, _OutOfTime)]:
        raise bugs[0]  # a workflow's own error fails the rollout: it is a bug to see
    if errors:
        running = len(errors) + len(pending)
        raise GroupTimeout(f"{running} of {len(tasks)} episodes still ran after {timeout:g} s",
                           f"an episode ran past rollout.episode_timeout_secs={timeout:g}")  # fmt: skip
    return [task.result() for task in tasks]


async def _episode(workflow: Callable, ctx: EpisodeContext, record, timeout: float, slots: Slots | None):
    """One episode in its turn: its time runs from there, so that waiting for a turn drops no group."""
    async with slots.turn() if slots else contextlib.nullcontext():
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await workflow(ctx, record)
        except TimeoutError:
            if deadline.expired():
                raise _OutOfTime() from None
            raise


def episode_stats(counts: Counter, episodes: int, n_dropped: int = 0) -> dict[str, float]:
    """The rollout statistics of multi-turn groups (beside the single-turn ones), from the summed counts of
    their ``episodes`` episodes (EPISODE_COUNTS) and the groups dropped for time."""
    episodes, turns = max(episodes, 1), max(counts["turns"], 1)
    stats = {f"rollout/{name}_per_episode": counts[name] / episodes for name in PER_EPISODE}
    stats["rollout/tool_error_ratio"] = counts["tool_errors"] / max(counts["tool_calls"], 1)
    stats["rollout/drifted_turn_ratio"] = counts["drifted_turns"] / turns
    stats["rollout/masked_token_share"] = 1 - counts["sampled_tokens"] / max(counts["tokens"], 1)
    stats |= tool_stats(counts, episodes)  # per tool name, and the results an agent sent back
    stats["rollout/dropped_groups"] = float(n_dropped)
    stats["rollout/replayed_turns"] = float(
        counts["replayed_turns"]
    )  # answered from journals after a restart
    return stats


def episode_groups(
    clients: Sequence, episodes: Episodes, prompts: Sequence, epoch: int
) -> tuple[list[Group], float]:
    """Every prompt's group at once (prompt i on server i % n): the groups (a group given up says why) and the
    seconds they took."""

    def one(i: int) -> Group:
        try:
            result = episodes.group(clients[i % len(clients)], prompts[i], epoch)
        except GroupDropped as exc:
            logger.warning("group of prompt %s dropped (%s): %s", prompts[i].query_id, exc.reason, exc)
            return Group(prompts[i], epoch, [], dropped=exc.reason, error=exc)
        return Group(prompts[i], epoch, result.rewards, result)

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        groups = list(pool.map(one, range(len(prompts))))
    return groups, time.monotonic() - start


def episodes_step(
    clients: Sequence,
    episodes: Episodes,
    prompts: Sequence,
    cfg: ExperimentConfig,
    path: Path,
    epoch: int,
    more: Callable[[], tuple[Sequence, int]] | None = None,
) -> StepRollout:
    """Synchronous RL with a multi-turn workflow: the groups of the step's batch ``prompts`` of ``epoch`` (under
    dynamic sampling, of more batches from ``more()`` while groups with equal rewards leave it short), the kept
    ones written to one batch file; its path is None when every group was dropped."""
    run_round = functools.partial(episode_groups, clients, episodes)
    filled, secs = draw_groups(run_round, prompts, epoch, more, cfg)
    counts: Counter = Counter()
    for g in filled.kept:
        counts.update(g.result.counts)
    given_up = sum(g.dropped in GIVEN_UP for g in filled.dropped)
    stats = episode_stats(counts, sum(len(g.rewards) for g in filled.kept), given_up)
    stats |= dynamic_stats(filled, len(prompts), cfg)
    if not filled.kept:
        return step_rollout(None, stats, filled)
    arrays = pack_episodes([[s for samples in g.result.samples for s in samples] for g in filled.kept], cfg)
    write_batch(path, arrays, {"n_prompts": len(filled.kept), "group_size": cfg.group_size})
    trained = ~arrays["prompt_mask"]
    generated = [g.result.counts for g in filled.kept + filled.dropped if g.result]  # every group that ran
    sampled = sum(c["sampled_tokens"] for c in generated)
    stats |= {
        "rollout/answer_len/avg": float(trained.sum() / len(arrays["rewards"])),
        "rollout/no_eos_ratio": float(arrays["seq_no_eos_mask"].mean()),
        "rollout/gen_tokens_per_s": sampled / max(secs, 1e-9),
        **cache_stats({name: sum(c[name] for c in generated) for name in CACHE_COUNTS}),
        "timeperf/actor_gen": secs,
    }
    return step_rollout(path, stats, filled)
