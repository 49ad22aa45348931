"""Where each step's samples come from: a step source gives the master a step's batch files, and after the step
records what it consumed.

    SyncRollouts   synchronous RL: the controller rolls the step's prompts out itself (gen.rollout)
    StoreRollouts  asynchronous RL: the oldest groups the rollout role left in the rollout store
    SftBatches     supervised warm-up: the prompts with their reference solutions

A source's `state_dict` (a component of recover checkpoints) says where the next step's samples come from, as
the last finished step left it.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from areal_hpc.agent import ChatRenderer, load_tools
from areal_hpc.config import ExperimentConfig, InputError, data_parallel_size
from areal_hpc.control import Ledger, RunDir, dead_workers
from areal_hpc.data import (
    PromptDataset,
    RolloutStore,
    ShardedSampler,
    read_attrs,
    read_batch,
    sft_arrays,
    write_batch,
)
from areal_hpc.gen import (
    CACHE_COUNTS,
    GIVEN_UP,
    RepeatedAgentError,
    by_cause,
    cache_stats,
    episode_stats,
    episodes_step,
    repeats,
    rollout_step,
)
from areal_hpc.master.guard import StepGuard

logger = logging.getLogger("master")
STORE_POLL_SECS = 0.05
ROLLOUT_DEAD_SECS = 60.0
EQUAL_REWARDS = (
    "every group's rewards were equal in dynamic_sampling_max_rounds={rounds} batches of prompts (the prompts "
    "are all too easy or too hard for the model), and dynamic sampling trains on no such group"
)


@dataclass
class StepBatch:
    """One step's samples: batch files and the groups each names. A file's `group_ids` say which of its groups
    each row is in (rows of a group vary in number: a row per answer, or per model turn of each answer); the
    master counts the rows when it buffers them."""

    files: list[tuple[str, list[str]]]  # (path, groups)
    used: list[tuple[str, int]]  # (query id, the prompt's epoch) of every group
    stats: dict[str, float] = field(default_factory=dict)
    # (query id, epoch, why) of the groups not trained on: given up (episodes' time, agents' errors), or
    # dropped by dynamic sampling or the success-rate filter
    dropped: list[tuple[str, int, str]] = field(default_factory=list)


def record_used(ledger: Ledger, step: int, used: list[tuple[str, int]]) -> None:
    """Ledger records of the prompts `step` used, one per prompt epoch (the rollout side may run ahead into
    the next epoch)."""
    for epoch in sorted({e for _, e in used}):
        ledger.record(epoch, step, [i for i, e in used if e == epoch])


def record_dropped(ledger: Ledger, step: int, dropped: list[tuple[str, int, str]]) -> None:
    """Ledger records of the groups `step` dropped, one per prompt epoch and reason."""
    for epoch, reason in sorted({(e, r) for _, e, r in dropped}):
        ids = [i for i, e, r in dropped if (e, r) == (epoch, reason)]
        ledger.record(epoch, step, ids, dropped=True, reason=reason)


class PromptSteps:
    """The prompts of each step, drawn by a sampler whose state is kept as the last finished step left it."""

    def __init__(self, cfg: ExperimentConfig, run: RunDir, dataset: PromptDataset):
        self.cfg, self.run, self.dataset = cfg, run, dataset
        self.sampler = ShardedSampler(len(dataset), 0, 1, cfg.seed, cfg.dataset.train_bs_n_seqs)
        self.mark = self.sampler.state_dict()
        self.ledger = Ledger(run.ledger)

    def prompts(self) -> tuple[list, int]:
        epoch = self.sampler.epoch
        return [self.dataset[i] for i in self.sampler.next_batch()], epoch

    def consumed(self, step: int, batch: StepBatch) -> None:
        """Record the step's prompts, then drop its data (the original's clear_data_cache)."""
        record_used(self.ledger, step + 1, batch.used)
        record_dropped(self.ledger, step + 1, batch.dropped)
        shutil.rmtree(self.run.step_data(step), ignore_errors=True)
        self.mark = self.sampler.state_dict()

    def state_dict(self) -> dict:
        return {"sampler": self.mark}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.mark = self.sampler.state_dict()


class SyncRollouts(PromptSteps):
    def __init__(
        self, cfg: ExperimentConfig, run: RunDir, dataset: PromptDataset, clients, rewards, episodes=None
    ):
        super().__init__(cfg, run, dataset)
        self.clients, self.rewards, self.episodes = (
            clients,
            rewards,
            episodes,
        )  # episodes: a multi-turn workflow's

    def next(self, step: int) -> StepBatch:
        """Generate and score the step's groups: its batch of prompts and, under dynamic sampling, more batches
        while groups with equal rewards leave it short."""
        drawn: list[tuple[list, int]] = []

        def draw() -> tuple[list, int]:
            drawn.append(self.prompts())
            return drawn[-1]

        path = self.run.step_data(step) / "rollout.h5"
        prompts, epoch = draw()
        if self.episodes is None:
            rolled = rollout_step(self.clients, self.rewards, prompts, self.cfg, path, epoch, draw)
        else:
            rolled = episodes_step(self.clients, self.episodes, prompts, self.cfg, path, epoch, draw)
            for batch, batch_epoch in drawn:
                for prompt in batch:
                    self.episodes.finished(prompt, batch_epoch)
        if rolled.path is None:
            raise no_group_error(step, self.cfg, rolled)
        files = [(str(rolled.path), group_names(rolled.kept))]
        return StepBatch(files, rolled.kept, rolled.stats, rolled.dropped)


def group_names(groups: list[tuple[str, int]]) -> list[str]:
    """The names of a step's groups (query id, epoch) in the master's buffer: the query id, with the epoch when
    the step took the prompt in two epochs (dynamic sampling's later rounds may cross into the next one)."""
    twice = {i for i, n in Counter(i for i, _ in groups).items() if n > 1}
    return [f"{i}@epoch{e}" if i in twice else i for i, e in groups]


def no_group_error(step: int, cfg: ExperimentConfig, rolled) -> Exception:
    """Why ``step`` kept no group (``rolled``: its StepRollout), as the error that ends the attempt, the groups it
    gave up counted by cause (the cause is read first, not what followed from it). A new attempt resumes before
    the step and draws the same prompts: when every group given up failed by the agent's error of one cause
    (gen.repeats), or none was given up (equal rewards), it would fail alike and the run ends (an InputError: not
    restarted); episodes past their time may fare better."""
    reasons = [f"every group was dropped: {by_cause(rolled.given_up)}"] if rolled.given_up else []
    if rolled.stats.get("rollout/dynamic_sampling_dropped"):
        reasons.append(EQUAL_REWARDS.format(rounds=cfg.dynamic_sampling_max_rounds))
    message = f"step {step + 1} has no group to train on: {'; '.join(reasons) or 'no group was generated'}"
    if not rolled.given_up:
        return InputError(message)
    if repeats(rolled.given_up):
        return RepeatedAgentError(f"{message}; a new attempt would draw the same prompts and fail alike")
    return RuntimeError(message)


class SftBatches(PromptSteps):
    def __init__(self, cfg: ExperimentConfig, run: RunDir, dataset: PromptDataset, tokenizer):
        super().__init__(cfg, run, dataset)
        self.tokenizer = tokenizer
        # Worked conversations (a record's messages) render with the tools the RL run will offer.
        tools = [tool.schema() for tool in load_tools(cfg.rollout.tools)]
        self.renderer = ChatRenderer(tokenizer, tools) if any(p.messages for p in dataset.samples) else None

    def next(self, step: int) -> StepBatch:
        """The step's prompts followed by their first reference solution (or their worked conversation)."""
        prompts, epoch = self.prompts()
        transcript = self.renderer.transcript if self.renderer else None
        arrays = sft_arrays(prompts, self.tokenizer, transcript)
        path = write_batch(self.run.step_data(step) / "sft.h5", arrays)
        ids = [p.query_id for p in prompts]
        return StepBatch([(str(path), ids)], [(i, epoch) for i in ids])  # no group_ids: a row a prompt


class StoreRollouts:
    """The groups of the rollout store, oldest first; a file is removed once the step that trained on it ended."""

    def __init__(self, cfg: ExperimentConfig, run: RunDir, guard: StepGuard):
        self.cfg, self.run, self.guard = cfg, run, guard
        self.store, self.ledger = RolloutStore(run.rollouts), Ledger(run.ledger)
        self.dropped: list[tuple[Path, dict]] = []  # the drop markers the current step records
        self.min_groups = data_parallel_size(cfg) if cfg.dynamic_sampling else 1  # of a short batch

    def next(self, step: int) -> StepBatch:
        start, n = time.monotonic(), self.cfg.dataset.train_bs_n_seqs
        paths = self.wait(n)
        waited = time.monotonic() - start
        attrs = [read_attrs(path) for path in paths]
        self.dropped = self.store.dropped()  # recorded with this step: those dropped meanwhile
        stats = rollout_stats(paths, attrs, [d for _, d in self.dropped]) | {"timeperf/wait_rollouts": waited}
        if self.cfg.dynamic_sampling:
            equal = sum(d.get("reason") == "equal_rewards" for _, d in self.dropped)
            stats |= {
                "rollout/dynamic_sampling_dropped": float(equal),
                "rollout/short_batch": float(len(paths) < n),
            }
        # A prompt may come back in a later epoch: the file's name names the group.
        files = [(str(path), [path.stem]) for path in paths]
        dropped = [(d["query_id"], d["epoch"], d.get("reason", "success_rate")) for _, d in self.dropped]
        return StepBatch(files, [(a["query_id"], a["epoch"]) for a in attrs], stats, dropped)

    def wait(self, n: int) -> list[Path]:
        """The n oldest groups of the store, once there; under dynamic sampling, those there once they and the
        groups it dropped since the last step make dynamic_sampling_max_rounds batches (a short batch). Fails
        when the rollout role stopped beating, or when dynamic sampling dropped that many and kept none."""
        bound = self.cfg.dynamic_sampling_max_rounds * n if self.cfg.dynamic_sampling else None
        while len(paths := self.store.ready()) < n:
            # Past the bound a short batch is trained on, if it can be split over the data-parallel ranks.
            splittable = not paths or len(paths) >= self.min_groups
            if bound and splittable and len(paths) + self.store.n_dropped() >= bound:  # counted cheaply first
                equal = sum(d.get("reason") == "equal_rewards" for _, d in self.store.dropped())
                if len(paths) + equal >= bound:
                    return self.short_batch(paths, n, equal)
            self.guard.waiting("waiting for rollouts")
            if dead_workers(self.run.heartbeats, ["rollout"], ROLLOUT_DEAD_SECS):
                raise RuntimeError(f"the rollout role stopped (no heartbeat for {ROLLOUT_DEAD_SECS:.0f} s)")
            time.sleep(STORE_POLL_SECS)
        return paths[:n]

    def short_batch(self, paths: list[Path], n: int, equal: int) -> list[Path]:
        rounds = self.cfg.dynamic_sampling_max_rounds
        if not paths:
            raise InputError(
                f"dynamic sampling dropped {equal} groups and kept none: "
                + EQUAL_REWARDS.format(rounds=rounds)
            )
        logger.warning(
            "dynamic sampling dropped %d groups for equal rewards, %d of %d are ready "
            "(dynamic_sampling_max_rounds=%d): the step trains on a short batch", equal, len(paths), n, rounds,
        )  # fmt: skip
        return paths

    def consumed(self, step: int, batch: StepBatch) -> None:
        """Record the groups trained on and those dropped meanwhile (equal rewards, success rate, time); remove
        them."""
        record_used(self.ledger, step + 1, batch.used)
        record_dropped(self.ledger, step + 1, batch.dropped)
        self.store.remove([path for path, _ in self.dropped])
        self.store.remove([Path(path) for path, _ in batch.files])
        shutil.rmtree(self.run.step_data(step), ignore_errors=True)

    def state_dict(self) -> dict:
        return {}  # the store and the ledger are in the checkpoint; the rollout role resumes from them

    def load_state_dict(self, state: dict) -> None:
        pass


def rollout_stats(paths: list[Path], attrs: list[dict], dropped: list[dict] = ()) -> dict[str, float]:
    """Statistics of the groups a step trains on, as the synchronous rollout reports them (and those of their
    episodes when a multi-turn workflow made them; `dropped`: the drop markers the step records)."""
    answer_lens, no_eos = [], []
    for path in paths:
        arrays = read_batch(path, keys=["prompt_mask", "seq_no_eos_mask"])
        cu = arrays["cu_seqlens"]
        answer_lens += [
            int((~arrays["prompt_mask"][a:b]).sum()) for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
        no_eos += arrays["seq_no_eos_mask"].tolist()
    stats = {
        "rollout/answer_len/avg": float(np.mean(answer_lens)),
        "rollout/no_eos_ratio": float(np.mean(no_eos)),
        "rollout/interrupted_answers": float(sum(a["n_interrupted"] for a in attrs)),
        "rollout/gen_secs/avg": float(np.mean([a["gen_secs"] for a in attrs])),
        # a group's file written before these were counted has none: 0
        **cache_stats({name: sum(a.get(name, 0) for a in attrs) for name in CACHE_COUNTS}),
    }
    if any("episodes" in a for a in attrs):
        counts = Counter()
        for a in attrs:  # EPISODE_COUNTS, and per tool name (tool_calls/<name>)
            counts.update({k.removeprefix("episode_"): v for k, v in a.items() if k.startswith("episode_")})
        given_up = sum(d.get("reason") in GIVEN_UP for d in dropped)
        stats |= episode_stats(counts, sum(a.get("episodes", 0) for a in attrs), given_up)
    return stats
