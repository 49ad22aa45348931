"""Synchronous rollout of one step: prompts -> generation servers -> rewards -> a packed batch file.

Each prompt's group_size answers go to one server (prefix-cache reuse, as the original's manager does),
prompts are spread round-robin over the servers, and all requests of a step are submitted at once: each
server's client sends it at most its capacity (max_running_requests) and holds the rest back
(`gen.client.Admission`), so a request's timeout does not run while it queues behind the others.

Under dynamic_sampling (DAPO), a group whose answers all have the same reward is dropped and the step draws
more batches of prompts, dynamic_sampling_max_rounds in all, until its batch is full (`fill_batch`); kept groups
past it are dropped as surplus, so that every prompt drawn is used once, trained on or dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from areal_hpc.agent import Sample
from areal_hpc.config import GEN_BACKENDS, ExperimentConfig, data_parallel_size, gen_backend
from areal_hpc.control import timeline
from areal_hpc.data import PromptSample, write_batch
from areal_hpc.gen.client import ROUTED_EXPERTS
from areal_hpc.gen.partial import PartialAnswer, answers_of, cache_counts, cache_stats
from areal_hpc.gen.routing import BATCH_KEY, model_shape, packed

logger = logging.getLogger("rollout")
EQUAL_REWARDS_TOL = 1e-9


def sampling_params(cfg: ExperimentConfig) -> dict:
    """SGLang sampling_params of the training answers."""
    gen = cfg.ppo.gen
    return {
        "max_new_tokens": gen.max_new_tokens,
        "min_new_tokens": gen.min_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "stop_token_ids": list(gen.stop_token_ids),
        "n": cfg.group_size,
    }


def prompt_seed(seed: int, query_id: str, epoch: int) -> int:
    """The sampling seed of a prompt's group in an epoch, the same in the synchronous and asynchronous paths
    (so that with max_head_offpolicyness 0 both sample the same answers)."""
    return (seed * 1_000_003 + epoch * 7_919 + zlib.crc32(query_id.encode())) % 2**31


def group_params(cfg: ExperimentConfig, query_id: str, epoch: int) -> dict:
    """Sampling params of one prompt's group: seeded only where the generation backend seeds each answer
    (config/backends.py); nothing else relies on the seed. Under routing replay (actor.router_replay rollout)
    they ask for each token's routed experts, in the shape of the actor's model (gen.routing)."""
    params = sampling_params(cfg)
    if GEN_BACKENDS[gen_backend(cfg)].seeded_sampling:
        params["sampling_seed"] = prompt_seed(cfg.seed, query_id, epoch)
    if cfg.actor.router_replay == "rollout":
        params[ROUTED_EXPERTS] = model_shape(cfg.actor.path).param()
    return params


def generate_groups(
    clients: Sequence, prompts: Sequence[PromptSample], params: Sequence[dict]
) -> list[list[tuple[PartialAnswer, str]]]:
    """group_size (answer, text) per prompt (sampled with params[i]), all prompts submitted at once, prompt i
    on server i % len(servers)."""

    def one(i: int) -> list[tuple[PartialAnswer, str]]:
        client, prompt = clients[i % len(clients)], list(prompts[i].input_ids)
        responses = client.generate([prompt], params[i])
        texts = [r["text"] for r in responses]
        return list(zip(answers_of(client, responses, prompt, params[i]), texts, strict=True))

    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        return list(pool.map(one, range(len(prompts))))


def scores(success: np.ndarray, cfg: ExperimentConfig) -> np.ndarray:
    """The original's reward: ((success - 0.5) * 2 - bias) * scaling."""
    ppo = cfg.ppo
    return (((success - 0.5) * 2 - ppo.reward_output_bias) * ppo.reward_output_scaling).astype(np.float32)


def pack_groups(
    prompts: Sequence[PromptSample], groups: list[list[PartialAnswer]], success: np.ndarray
) -> dict:
    """Packed arrays of prompt + answer sequences (batch keys of docs/architecture.md), without rewards; with
    routing replay, their routed experts (gen.routing.BATCH_KEY)."""
    ids, prompt_mask, logprobs, lengths = [], [], [], []
    no_eos, group_ids, starts, ends, routings = [], [], [], [], []
    for g, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        for answer in group:
            p = list(prompt.input_ids)
            ids += p + list(answer.output_ids)
            prompt_mask += [True] * len(p) + [False] * len(answer.output_ids)
            logprobs += [0.0] * len(p) + list(answer.logprobs)
            lengths.append(len(p) + len(answer.output_ids))
            no_eos.append(answer.truncated)
            group_ids.append(g)
            starts.append(answer.version_start)
            ends.append(answer.version_end)
            routings.append(answer.routing)
    arrays = {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "packed_input_ids": np.asarray(ids, dtype=np.int64),
        "prompt_mask": np.asarray(prompt_mask, dtype=bool),
        "packed_logprobs": np.asarray(logprobs, dtype=np.float32),
        "seq_no_eos_mask": np.asarray(no_eos, dtype=bool),
        "group_ids": np.asarray(group_ids, dtype=np.int64),
        "version_start": np.asarray(starts, dtype=np.int64),
        "version_end": np.asarray(ends, dtype=np.int64),
        "success": success.astype(np.float32),
    }
    return with_routing(arrays, routings, lengths)


def with_routing(arrays: dict, routings: Sequence, lengths: Sequence[int]) -> dict:
    """``arrays`` with the sequences' routed experts under BATCH_KEY, when they have any (routing replay)."""
    routing = packed(routings, lengths)
    return arrays if routing is None else {**arrays, BATCH_KEY: routing}


def pack_episodes(groups: Sequence[Sequence[Sample]], cfg: ExperimentConfig) -> dict:
    """Packed arrays of the samples of each group's episodes (batch keys of docs/architecture.md), rewards
    included; ``token_versions`` holds each trained token's weight version (-1 on the others)."""
    rows = [(g, s) for g, samples in enumerate(groups) for s in samples]
    if not rows:
        raise ValueError("no episode of these groups took a model turn; there is nothing to train on")
    masked = [np.asarray(s.prompt_mask, dtype=bool) for _, s in rows]
    trained = [s.sampled_versions or [0] for _, s in rows]
    success = np.asarray([s.reward for _, s in rows], dtype=np.float32)
    discount = np.asarray([s.discount for _, s in rows], dtype=np.float32)
    arrays = {
        "cu_seqlens": np.concatenate([[0], np.cumsum([len(s.ids) for _, s in rows])]).astype(np.int64),
        "packed_input_ids": np.concatenate([np.asarray(s.ids, dtype=np.int64) for _, s in rows]),
        "prompt_mask": np.concatenate(masked),
        "packed_logprobs": np.concatenate(
            [np.where(m, 0.0, np.asarray(s.logprobs)) for m, (_, s) in zip(masked, rows, strict=True)]
        ).astype(np.float32),
        "token_versions": np.concatenate(
            [np.where(m, -1, np.asarray(s.versions)) for m, (_, s) in zip(masked, rows, strict=True)]
        ).astype(np.int64),
        "seq_no_eos_mask": np.asarray([s.truncated for _, s in rows], dtype=bool),
        "group_ids": np.asarray([g for g, _ in rows], dtype=np.int64),
        "version_start": np.asarray([min(v) for v in trained], dtype=np.int64),
        "version_end": np.asarray([max(v) for v in trained], dtype=np.int64),
        "success": success,
        "rewards": scores(success, cfg) * discount,
    }
    return with_routing(arrays, [s.routing for _, s in rows], [len(s.ids) for _, s in rows])


# --- a synchronous step: rounds of groups, dynamic sampling, one batch file -----------------------------------


@dataclass(frozen=True, eq=False)
class Group:
    """A prompt's group, generated and scored: what a synchronous step keeps or drops."""

    prompt: PromptSample
    epoch: int  # the prompt's epoch: a step's later rounds may draw from the next one
    rewards: Sequence[float]  # the task reward (success) of each answer or episode
    result: object = None  # what packs it: its answers (single-turn), its GroupResult (multi-turn)
    dropped: str | None = None  # why it is not trained on (timeout, agent_error, equal_rewards, surplus)
    error: Exception | None = None  # a group given up: why (gen.episodes.GroupDropped)


@dataclass(frozen=True)
class Filled:
    """A step's groups: those it trains on (at most its batch), those it dropped, and the rounds drawn."""

    kept: list[Group]
    dropped: list[Group]
    rounds: int


class StepRollout(NamedTuple):
    """What a synchronous step rolled out: its batch file (None when no group was kept), its statistics, and
    (query id, epoch) of the groups in the file, in file order, (query id, epoch, why) of those dropped, and
    (query id, epoch, error) of those given up (episodes' time, agents' errors)."""

    path: Path | None
    stats: dict[str, float]
    kept: list[tuple[str, int]]
    dropped: list[tuple[str, int, str]]
    given_up: tuple[tuple[str, int, Exception], ...] = ()


def equal_rewards(rewards: Sequence[float]) -> bool:
    """True when every answer (episode) of a group has the same task reward: its advantages are all zero, so
    DAPO's dynamic sampling drops it."""
    r = np.asarray(rewards, dtype=np.float64)
    return r.size > 0 and float(r.max() - r.min()) <= EQUAL_REWARDS_TOL


def fill_batch(
    draw: Callable[[], list[Group]], n: int, dynamic: bool = False, max_rounds: int = 1, min_kept: int = 1
) -> Filled:
    """The groups of a step of ``n``: a round of groups from ``draw()``; with dynamic sampling, the groups whose
    rewards are all equal are dropped and more rounds drawn while fewer than ``n`` are kept, ``max_rounds`` in
    all, and past them while some but fewer than ``min_kept`` (the data-parallel ranks) are kept. Kept groups
    past the first ``n`` are surplus: dropped, so that every drawn prompt is used once."""
    kept, dropped, rounds = [], [], 0
    while True:
        rounds += 1
        for group in draw():
            if group.dropped is None and dynamic and equal_rewards(group.rewards):
                group = dataclasses.replace(group, dropped="equal_rewards")
            (dropped if group.dropped else kept).append(group)
        if not dynamic or len(kept) >= n:
            break
        # Past max_rounds a short batch is trained on, if it can be split over the data-parallel ranks.
        if rounds >= max_rounds and (not kept or len(kept) >= min_kept):
            break
    surplus = [dataclasses.replace(g, dropped="surplus") for g in kept[n:]]
    return Filled(kept[:n], dropped + surplus, rounds)


def draw_groups(
    run_round: Callable[[Sequence[PromptSample], int], tuple[list[Group], float]],
    prompts: Sequence[PromptSample],
    epoch: int,
    more: Callable[[], tuple[Sequence[PromptSample], int]] | None,
    cfg: ExperimentConfig,
) -> tuple[Filled, float]:
    """`fill_batch` over the step's batch ``prompts`` of ``epoch`` and, under dynamic sampling, the batches
    ``more()`` draws (their own epochs), each rolled out by ``run_round(prompts, epoch) -> (groups, generation
    seconds)``; the step's groups and their generation seconds."""
    batches, secs = [(prompts, epoch)], []

    def draw() -> list[Group]:
        groups, s = run_round(*(batches.pop() if batches else more()))
        secs.append(s)
        return groups

    dynamic = cfg.dynamic_sampling
    max_rounds = cfg.dynamic_sampling_max_rounds if dynamic and more else 1
    filled = fill_batch(draw, len(prompts), dynamic, max_rounds, data_parallel_size(cfg) if dynamic else 1)
    if dynamic and 0 < len(filled.kept) < len(prompts):
        logger.warning(
            "dynamic sampling kept %d of %d groups in %d rounds (dynamic_sampling_max_rounds): the step trains "
            "on a short batch", len(filled.kept), len(prompts), filled.rounds,
        )  # fmt: skip
    return filled, sum(secs)


def dynamic_stats(filled: Filled, n: int, cfg: ExperimentConfig) -> dict[str, float]:
    """The statistics of dynamic sampling (none without it, so that such runs keep their statistics)."""
    if not cfg.dynamic_sampling:
        return {}
    reasons = Counter(g.dropped for g in filled.dropped)
    return {
        "rollout/dynamic_sampling_dropped": float(reasons["equal_rewards"]),
        "rollout/dynamic_sampling_rounds": float(filled.rounds),
        "rollout/surplus_groups": float(reasons["surplus"]),
        "rollout/short_batch": float(len(filled.kept) < n),
    }


def step_rollout(path: Path | None, stats: dict[str, float], filled: Filled) -> StepRollout:
    """The StepRollout of a step's groups."""
    used = [(g.prompt.query_id, g.epoch) for g in filled.kept]
    dropped = [(g.prompt.query_id, g.epoch, g.dropped) for g in filled.dropped]
    given_up = tuple((g.prompt.query_id, g.epoch, g.error) for g in filled.dropped if g.error)
    return StepRollout(path, stats, used, dropped, given_up)


def answer_groups(
    clients: Sequence, rewards, cfg: ExperimentConfig, prompts: Sequence[PromptSample], epoch: int
) -> tuple[list[Group], float]:
    """Each prompt's group_size answers, generated and scored; the groups and the generation seconds."""
    start = time.monotonic()
    params = [group_params(cfg, p.query_id, epoch) for p in prompts]
    with timeline.span("generate"):
        generated = generate_groups(clients, prompts, params)
    gen_secs = time.monotonic() - start
    items = [
        (text, p, a.output_ids) for p, group in zip(prompts, generated, strict=True) for a, text in group
    ]
    with timeline.span("reward"):
        success = np.asarray(rewards.score_batch(items), dtype=np.float32)
    cuts = np.cumsum([len(group) for group in generated])[:-1]
    groups = [
        Group(p, epoch, s, [answer for answer, _ in group])
        for p, group, s in zip(prompts, generated, np.split(success, cuts), strict=True)
    ]
    return groups, gen_secs


def rollout_step(
    clients: Sequence,
    rewards,
    prompts: Sequence[PromptSample],
    cfg: ExperimentConfig,
    path: Path,
    epoch: int,
    more: Callable[[], tuple[Sequence[PromptSample], int]] | None = None,
) -> StepRollout:
    """Generate and score the step's groups (the batch ``prompts`` of ``epoch``; under dynamic sampling, more
    batches from ``more()`` while groups with equal rewards leave it short) and write the kept ones to the batch
    file ``path``."""
    start = time.monotonic()
    run_round = functools.partial(answer_groups, clients, rewards, cfg)
    filled, gen_secs = draw_groups(run_round, prompts, epoch, more, cfg)
    stats = dynamic_stats(filled, len(prompts), cfg)
    if not filled.kept:
        return step_rollout(None, stats, filled)
    success = np.concatenate([g.rewards for g in filled.kept])
    groups = [g.result for g in filled.kept]
    arrays = pack_groups([g.prompt for g in filled.kept], groups, success)
    arrays["rewards"] = scores(success, cfg)
    with timeline.span("write_batch"):
        write_batch(path, arrays, {"n_prompts": len(groups), "group_size": cfg.group_size})
    answer_lens = [len(a.output_ids) for group in groups for a in group]
    answers = [a for g in filled.kept + filled.dropped for a in g.result or ()]  # every answer generated
    generated = [len(a.output_ids) for a in answers]
    stats = {
        "rollout/answer_len/avg": float(np.mean(answer_lens)),
        "rollout/no_eos_ratio": float(arrays["seq_no_eos_mask"].mean()),
        "rollout/gen_tokens_per_s": sum(generated) / max(gen_secs, 1e-9),
        **cache_stats(cache_counts(answers)),
        "timeperf/actor_gen": gen_secs,
        "timeperf/rew_inf": time.monotonic() - start - gen_secs,
    } | stats
    return step_rollout(path, stats, filled)
