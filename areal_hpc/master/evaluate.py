"""Evaluation during training: greedy accuracy on the held-out prompts (dataset.valid_path)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from areal_hpc.data import PromptDataset
from areal_hpc.eval import greedy_accuracy
from areal_hpc.monitor import StatsLog

logger = logging.getLogger("master")


class HeldoutEval:
    """Logged as eval/greedy_acc at the step it was taken; a component of recover checkpoints (its history)."""

    def __init__(
        self, clients: Sequence, prompts: PromptDataset | None, rewards, max_new_tokens: int, stats: StatsLog
    ):
        self.clients, self.prompts, self.rewards = clients, prompts, rewards
        self.max_new_tokens, self.stats = max_new_tokens, stats
        self.history: list[tuple[int, float]] = []

    def __call__(self, step: int) -> float | None:
        if self.prompts is None:
            return None
        acc = greedy_accuracy(self.clients, self.prompts, self.rewards, self.max_new_tokens)
        self.stats.write(step, {"eval/greedy_acc": acc})
        logger.info("Held-out greedy accuracy after %d steps: %.3f", step, acc)
        self.history.append((step, acc))
        return acc

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.history = [tuple(entry) for entry in state["history"]]
