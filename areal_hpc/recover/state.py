"""What a recover checkpoint must agree with, and whether an attempt resumes (recover_mode).

recover_mode, as in the original (REFERENCE.md section 7):
- auto: every attempt resumes from the newest valid checkpoint when there is one, else starts fresh;
- fault: the first attempt starts fresh; later ones (requeues, restarts, `submit --recover`) resume as auto;
- resume: every attempt must resume; no valid checkpoint is an error;
- disabled: no checkpoints, no restarts.
"""

from __future__ import annotations

from typing import Any

from areal_hpc.config import ExperimentConfig

# The settings a checkpoint's data layout depends on: resuming across a change would mix incompatible data.
IDENTITY_FIELDS = (
    "experiment_name",
    "trial_name",
    "dataset.train_bs_n_seqs",
    "group_size",
    "cluster.n_nodes",
    "actor.path",
)


class RecoverError(RuntimeError):
    """A run cannot resume: no checkpoint where one is required, or one written under other settings."""


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def identity(cfg: ExperimentConfig) -> dict[str, Any]:
    """The settings a checkpoint records and a resume must match."""
    return {name: _get(cfg, name) for name in IDENTITY_FIELDS}


def check_compatible(saved: dict[str, Any], cfg: ExperimentConfig, where: str) -> None:
    """RecoverError naming the first setting that changed since checkpoint `where` was written."""
    for name, now in identity(cfg).items():
        if name in saved and saved[name] != now:
            raise RecoverError(
                f"cannot resume from {where}: {name} was {saved[name]!r} when it was written and is now "
                f"{now!r}; restore the setting, or start a new trial"
            )


def resumes(mode: str, attempt: int, found: bool, where: str) -> bool:
    """Whether attempt `attempt` resumes, given whether a valid checkpoint was `found` (in `where`)."""
    if mode == "disabled":
        return False
    if mode == "resume" and not found:
        raise RecoverError(f"recover_mode is resume but {where} holds no valid recover checkpoint")
    if mode == "fault" and attempt == 0:
        return False
    return found
