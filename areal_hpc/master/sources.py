"""Where each step's samples come from: a step source gives the master a step's batch files, and after the step
records what it consumed.

    SyncRollouts   synchronous RL: the controller rolls the step's prompts out itself (gen.rollout)
    StoreRollouts  asynchronous RL: the oldest groups the rollout role left in the rollout store
    SftBatches     supervised warm-up: the prompts with their reference solutions

A source's `state_dict` (a component of recover checkpoints) says where the next step's samples come from, as
the last finished step left it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from areal_hpc.config import ExperimentConfig
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
from areal_hpc.gen import rollout_step
from areal_hpc.master.guard import StepGuard

STORE_POLL_SECS = 0.05
ROLLOUT_DEAD_SECS = 60.0


@dataclass
class StepBatch:
    """One step's samples: batch files whose rows are `group_size` answers of each group they name."""

    files: list[tuple[str, list[str]]]  # (path, groups)
    group_size: int
    used: list[tuple[str, int]]  # (query id, the prompt's epoch) of every group
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return sum(len(groups) for _, groups in self.files) * self.group_size


def record_used(ledger: Ledger, step: int, used: list[tuple[str, int]], dropped: bool = False) -> None:
    """Ledger records of the prompts `step` used, one per prompt epoch (the rollout side may run ahead into
    the next epoch)."""
    for epoch in sorted({e for _, e in used}):
        ledger.record(epoch, step, [i for i, e in used if e == epoch], dropped=dropped)


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
        shutil.rmtree(self.run.step_data(step), ignore_errors=True)
        self.mark = self.sampler.state_dict()

    def state_dict(self) -> dict:
        return {"sampler": self.mark}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.mark = self.sampler.state_dict()


class SyncRollouts(PromptSteps):
    def __init__(self, cfg: ExperimentConfig, run: RunDir, dataset: PromptDataset, clients, rewards):
        super().__init__(cfg, run, dataset)
        self.clients, self.rewards = clients, rewards

    def next(self, step: int) -> StepBatch:
        """Generate and score the step's groups."""
        prompts, epoch = self.prompts()
        path = self.run.step_data(step) / "rollout.h5"
        path, stats = rollout_step(self.clients, self.rewards, prompts, self.cfg, path, epoch)
        ids = [p.query_id for p in prompts]
        return StepBatch([(str(path), ids)], self.cfg.group_size, [(i, epoch) for i in ids], stats)


class SftBatches(PromptSteps):
    def __init__(self, cfg: ExperimentConfig, run: RunDir, dataset: PromptDataset, tokenizer):
        super().__init__(cfg, run, dataset)
        self.tokenizer = tokenizer

    def next(self, step: int) -> StepBatch:
        """The step's prompts followed by their first reference solution."""
        prompts, epoch = self.prompts()
        path = write_batch(self.run.step_data(step) / "sft.h5", sft_arrays(prompts, self.tokenizer))
        ids = [p.query_id for p in prompts]
        return StepBatch([(str(path), ids)], 1, [(i, epoch) for i in ids])


class StoreRollouts:
    """The groups of the rollout store, oldest first; a file is removed once the step that trained on it ended."""

    def __init__(self, cfg: ExperimentConfig, run: RunDir, guard: StepGuard):
        self.cfg, self.run, self.guard = cfg, run, guard
        self.store, self.ledger = RolloutStore(run.rollouts), Ledger(run.ledger)

    def next(self, step: int) -> StepBatch:
        start = time.monotonic()
        paths = self.wait(self.cfg.dataset.train_bs_n_seqs)
        waited = time.monotonic() - start
        attrs = [read_attrs(path) for path in paths]
        stats = rollout_stats(paths, attrs) | {"timeperf/wait_rollouts": waited}
        # A prompt may come back in a later epoch: the file's name names the group.
        files = [(str(path), [path.stem]) for path in paths]
        return StepBatch(files, self.cfg.group_size, [(a["query_id"], a["epoch"]) for a in attrs], stats)

    def wait(self, n: int) -> list[Path]:
        """The n oldest groups of the store, once there; fails when the rollout role stopped beating."""
        while (paths := self.store.oldest(n)) is None:
            self.guard.waiting("waiting for rollouts")
            if dead_workers(self.run.heartbeats, ["rollout"], ROLLOUT_DEAD_SECS):
                raise RuntimeError(f"the rollout role stopped (no heartbeat for {ROLLOUT_DEAD_SECS:.0f} s)")
            time.sleep(STORE_POLL_SECS)
        return paths

    def consumed(self, step: int, batch: StepBatch) -> None:
        """Record the groups trained on and those the success-rate filter dropped meanwhile; remove them."""
        record_used(self.ledger, step + 1, batch.used)
        dropped = self.store.dropped()
        record_used(self.ledger, step + 1, [(d["query_id"], d["epoch"]) for _, d in dropped], dropped=True)
        self.store.remove([path for path, _ in dropped])
        self.store.remove([Path(path) for path, _ in batch.files])
        shutil.rmtree(self.run.step_data(step), ignore_errors=True)

    def state_dict(self) -> dict:
        return {}  # the store and the ledger are in the checkpoint; the rollout role resumes from them

    def load_state_dict(self, state: dict) -> None:
        pass


def rollout_stats(paths: list[Path], attrs: list[dict]) -> dict[str, float]:
    """Statistics of the groups a step trains on, as the synchronous rollout reports them."""
    answer_lens, no_eos = [], []
    for path in paths:
        arrays = read_batch(path, keys=["prompt_mask", "seq_no_eos_mask"])
        cu = arrays["cu_seqlens"]
        answer_lens += [
            int((~arrays["prompt_mask"][a:b]).sum()) for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
        no_eos += arrays["seq_no_eos_mask"].tolist()
    return {
        "rollout/answer_len/avg": float(np.mean(answer_lens)),
        "rollout/no_eos_ratio": float(np.mean(no_eos)),
        "rollout/interrupted_answers": float(sum(a["n_interrupted"] for a in attrs)),
        "rollout/gen_secs/avg": float(np.mean([a["gen_secs"] for a in attrs])),
    }
