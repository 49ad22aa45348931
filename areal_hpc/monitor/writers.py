"""Copies of the per-step statistics for the viewers users already have: TensorBoard event files
(`logging.tensorboard`) and an offline W&B run (`logging.wandb`), under the original's statistic names.

stats.jsonl stays the record (recovery rewinds it); these writers only follow it, so each attempt opens its own
and tells the viewer where this attempt starts over.
"""

from __future__ import annotations

import math
from pathlib import Path

from areal_hpc.config import ExperimentConfig, to_dict
from areal_hpc.control import RunDir

STEP = "global_step"  # W&B's x axis of every chart


def scalars(stats: dict) -> dict[str, float]:
    """The finite numbers of a statistics row (a viewer has no use for NaN or text)."""
    return {
        k: float(v)
        for k, v in stats.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardWriter:
    """Event files in `folder`; `purge_step`: TensorBoard drops what earlier attempts logged from this step on
    (the steps a resume runs again)."""

    def __init__(self, folder: Path, purge_step: int):
        from torch.utils.tensorboard import SummaryWriter  # loads TensorBoard: only when asked for

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def write(self, step: int, stats: dict) -> None:
        for name, value in scalars(stats).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a step takes seconds to minutes: a viewer sees each as it ends

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A W&B run of this attempt (named `<trial>-attempt<k>`, grouped by trial; `mode` offline: `wandb sync`
    uploads it later). W&B's own step only grows, and evaluation rows come after later steps (a job per
    checkpoint), so each row is a W&B step of its own and charts are drawn over `global_step`; a resumed
    attempt is a run of its own."""

    def __init__(self, folder: Path, project: str, trial: str, attempt: int, config: dict, mode: str):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)  # W&B writes its files in folder/wandb/
        self.run = wandb.init(
            dir=str(folder), project=project, group=trial, name=f"{trial}-attempt{attempt}", config=config,
            mode=mode, settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def write(self, step: int, stats: dict) -> None:
        self.run.log({**scalars(stats), STEP: step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # finish() returns before W&B's service has written the run's file: wait for it


def open_writers(cfg: ExperimentConfig, run: RunDir, attempt: int, first_step: int) -> list:
    """The writers `cfg.logging` asks for; `first_step`: the first step this attempt logs (a resume runs again
    what followed its checkpoint)."""
    log, out = cfg.logging, []
    if log.tensorboard:
        out.append(TensorBoardWriter(run.tensorboard, purge_step=first_step))
    if log.wandb:
        names = (cfg.experiment_name, cfg.trial_name, attempt)
        out.append(WandbWriter(run.wandb, *names, config=to_dict(cfg), mode=log.wandb_mode))
    return out
