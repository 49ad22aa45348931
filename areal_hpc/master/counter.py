"""Where the run is: epoch and step within it, global step, and the weight version the servers hold."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_hpc.config import ExperimentConfig
from areal_hpc.data import run_steps


@dataclass
class StepCounter:
    steps_per_epoch: int
    total_epochs: int
    total_steps: int
    global_step: int = 0
    version: int = 0
    step_secs: list[float] = field(default_factory=list)

    @property
    def epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    @property
    def epoch_step(self) -> int:
        return self.global_step % self.steps_per_epoch

    @property
    def done(self) -> bool:
        return self.global_step >= self.total_steps

    def eta_secs(self) -> float:
        recent = self.step_secs[-10:]
        return sum(recent) / max(len(recent), 1) * (self.total_steps - self.global_step)

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.global_step, self.version = state["global_step"], state["version"]


def make_counter(cfg: ExperimentConfig, n_prompts: int) -> StepCounter:
    per_epoch, total = run_steps(cfg.exp_ctrl, n_prompts, cfg.dataset.train_bs_n_seqs)
    return StepCounter(per_epoch, cfg.exp_ctrl.total_train_epochs, total)
