"""The rollout side of asynchronous RL: prompts -> generation servers -> reward -> the rollout store.

Rollout workers each own a shard of the prompts (`ShardedSampler` rank i of n_rollout_workers) and run
several rollouts at once on threads. Before starting a group, a thread asks the `GenerationManager` for a
rollout (the staleness bound); the group's group_size answers go to one server as one request and are
continued after interruptions (`partial.generate_group`), or, with a multi-turn workflow, its group_size
episodes run there side by side (`gen.episodes`); their task's reward scores them; a group whose answers all
have the same reward (dynamic_sampling) or whose success rate is outside [success_rate_lb, success_rate_ub]
is dropped (a marker in the store says so, with its reason), any other is written to the store; an agent that
fails the first batch of groups the same way ends the run (`episodes.FirstGroups`). A resumed
run skips the prompts that are already used in their epoch (`done`: trained on or dropped, from the ledger,
or waiting in the store).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import Ledger, timeline
from areal_hpc.data import PromptDataset, PromptSample, RolloutStore, ShardedSampler, read_attrs
from areal_hpc.gen.client import GenerationStopped
from areal_hpc.gen.episodes import Episodes, FirstGroups, GroupDropped, kept_count
from areal_hpc.gen.manager import GenerationManager
from areal_hpc.gen.partial import CACHE_COUNTS, cache_counts, generate_group
from areal_hpc.gen.rollout import equal_rewards, group_params, pack_episodes, pack_groups, scores

logger = logging.getLogger("rollout")
ALLOCATE_POLL_SECS = 0.01


@dataclass
class RolloutContext:
    """What every rollout thread of a process shares."""

    cfg: ExperimentConfig
    dataset: PromptDataset
    clients: Sequence
    rewards: object  # reward.TaskRewards
    manager: GenerationManager
    store: RolloutStore
    tokenizer: object
    stop: threading.Event
    done: dict[int, set[str]] = field(default_factory=dict)  # prompt epoch -> query ids already used
    episodes: Episodes | None = None  # a multi-turn workflow's (None: single_turn)
    first_groups: FirstGroups | None = None  # with episodes: whether the agent fails every group alike


class RolloutWorker:
    """One shard of the prompts, rolled out by `n_threads` threads."""

    def __init__(self, index: int, n_workers: int, ctx: RolloutContext, n_threads: int):
        self.index, self.ctx, self.n_threads = index, ctx, n_threads
        self.sampler = ShardedSampler(len(ctx.dataset), index, n_workers, ctx.cfg.seed, batch_size=1)
        self._lock = threading.Lock()
        self._sequence = 0
        self.errors: list[BaseException] = []

    def next_prompt(self) -> tuple[PromptSample, int, int]:
        """The next prompt of this worker's shard not used yet in its epoch, its sequence number and epoch."""
        with self._lock:
            while True:
                epoch = self.sampler.epoch
                (i,) = self.sampler.next_batch()
                prompt = self.ctx.dataset[i]
                if prompt.query_id not in self.ctx.done.get(epoch, ()):
                    self._sequence += 1
                    return prompt, self._sequence, epoch

    def threads(self) -> list[threading.Thread]:
        return [
            threading.Thread(target=self._loop, name=f"rollout{self.index}.{t}", daemon=True)
            for t in range(self.n_threads)
        ]

    def _loop(self) -> None:
        ctx = self.ctx
        try:
            while not ctx.stop.is_set():
                if not ctx.manager.allocate_rollout():
                    if ctx.manager.done():
                        return
                    time.sleep(ALLOCATE_POLL_SECS)
                    continue
                kept = False
                try:
                    kept = self.rollout(*self.next_prompt())
                finally:
                    ctx.manager.finish_rollout(kept)
        except GenerationStopped:
            return  # the role stops: a request still waiting for its server was given up, nothing failed
        except BaseException as exc:  # the role's main thread sees it and fails the run
            logger.exception("rollout thread failed")
            self.errors.append(exc)
            ctx.stop.set()

    def rollout(self, prompt: PromptSample, sequence: int, epoch: int) -> bool:
        """Generate, score and store one group; False when it was dropped (equal rewards, success rate)."""
        ctx, cfg = self.ctx, self.ctx.cfg
        birth = time.time()
        params = group_params(cfg, prompt.query_id, epoch)
        n_tokens = len(prompt.input_ids) * cfg.group_size
        group = f"{self.index}-{sequence}"  # a prompt may be in flight twice (an epoch ends meanwhile)
        server = ctx.manager.schedule_request(group, n_tokens)
        if ctx.episodes is not None:
            try:
                return self.episodes(ctx.clients[server], prompt, sequence, epoch, birth)
            finally:
                ctx.manager.release(group, n_tokens)
                ctx.manager.close_group(group)
        # Paused in place across an update (not interruptible), an answer reports only the version at its
        # end: that of its first tokens is at least the version published when it was sent.
        sent = None if cfg.interruptible_generation else ctx.manager.version
        try:
            answers = generate_group(
                ctx.clients[server], list(prompt.input_ids), params, min_version=sent, stop=ctx.stop
            )
        finally:
            ctx.manager.release(group, n_tokens)
            ctx.manager.close_group(group)
        texts = [ctx.tokenizer.decode(list(a.output_ids), skip_special_tokens=True) for a in answers]
        items = [(text, prompt, a.output_ids) for text, a in zip(texts, answers, strict=True)]
        with timeline.span("reward", overlap=True):  # rollout threads score side by side
            success = np.asarray(ctx.rewards.score_batch(items), np.float32)
        if cfg.dynamic_sampling and equal_rewards(success):
            ctx.store.put_dropped(self.index, sequence, birth, prompt.query_id, epoch, reason="equal_rewards")
            return False
        if not cfg.success_rate_lb <= float(success.mean()) <= cfg.success_rate_ub:
            ctx.store.put_dropped(self.index, sequence, birth, prompt.query_id, epoch)
            return False
        arrays = pack_groups([prompt], [answers], success)
        arrays["rewards"] = scores(success, cfg)
        arrays["birth_time"] = np.full(len(answers), birth, dtype=np.float64)
        attrs = {
            "query_id": prompt.query_id,
            "epoch": epoch,
            "worker": self.index,
            "gen_secs": time.time() - birth,
            "n_interrupted": sum(a.n_parts > 1 for a in answers),
            **cache_counts(answers),  # the prefix cache's statistics (master.sources)
        }
        with timeline.span("store_put", overlap=True):
            ctx.store.put(self.index, sequence, birth, arrays, attrs)
        return True

    def episodes(self, client, prompt: PromptSample, sequence: int, epoch: int, birth: float) -> bool:
        """Run, filter and store one group of a multi-turn workflow; False when it was dropped."""
        kept = self._episodes(client, prompt, sequence, epoch, birth)
        self.ctx.episodes.finished(prompt, epoch)  # stored or dropped; a group cut short keeps its journals
        return kept

    def _episodes(self, client, prompt: PromptSample, sequence: int, epoch: int, birth: float) -> bool:
        ctx, cfg = self.ctx, self.ctx.cfg
        try:
            result = ctx.episodes.group(client, prompt, epoch)
        except GroupDropped as exc:
            logger.warning("group of prompt %s dropped (%s): %s", prompt.query_id, exc.reason, exc)
            ctx.store.put_dropped(self.index, sequence, birth, prompt.query_id, epoch, reason=exc.reason)
            ctx.first_groups.ended(prompt.query_id, epoch, exc)
            return False
        ctx.first_groups.ended(prompt.query_id, epoch)
        if cfg.dynamic_sampling and equal_rewards(result.rewards):
            ctx.store.put_dropped(self.index, sequence, birth, prompt.query_id, epoch, reason="equal_rewards")
            return False
        if not cfg.success_rate_lb <= float(np.mean(result.rewards)) <= cfg.success_rate_ub:
            ctx.store.put_dropped(self.index, sequence, birth, prompt.query_id, epoch)
            return False
        arrays = pack_episodes([[s for samples in result.samples for s in samples]], cfg)
        arrays["birth_time"] = np.full(len(arrays["rewards"]), birth, dtype=np.float64)
        attrs = {"query_id": prompt.query_id, "epoch": epoch, "worker": self.index, "gen_secs": result.secs,
                 "n_interrupted": result.counts["interrupted_turns"], "episodes": len(result.rewards),
                 **{name: result.counts[name] for name in CACHE_COUNTS},
                 **{f"episode_{name}": float(n) for name, n in result.counts.items() if kept_count(name)}}  # fmt: skip
        with timeline.span("store_put", overlap=True):
            ctx.store.put(self.index, sequence, birth, arrays, attrs)
        return True


def used_prompts(ledger: Ledger, store: RolloutStore) -> tuple[dict[int, set[str]], int]:
    """The prompts already used in each epoch (recorded in the ledger, waiting in the store, or dropped) and
    the number of groups waiting in the store: where a resumed rollout side carries on."""
    done = ledger.consumed_by_epoch()
    stored = store.ready()
    found = [(a["epoch"], a["query_id"]) for a in map(read_attrs, stored)]
    found += [(d["epoch"], d["query_id"]) for _, d in store.dropped()]
    for epoch, query_id in found:
        done.setdefault(int(epoch), set()).add(query_id)
    return done, len(stored)
