"""The controller's recover checkpoints: one collects everything that has a `state_dict`.

A checkpoint of global step N (`recover.Checkpoints`, written atomically with a manifest) holds the trainer
ranks' part (the shards of the trained models' weights and optimizer state, one copy in all; the LR
schedules; each rank's generators), the ledger and the rollout store as they are, and `controller.json`: the
identity settings a resume must agree with and the `state_dict()` of every component of the controller (the
step counter, the step source's sampler, the frequency controls, the evaluation history).

Saving does not hold training up while the shards are written: `save` returns once the trainer ranks copied
their state to CPU memory; training goes on while they write it, and `finish` seals the checkpoint (its
manifest, from the sizes and sha256 the ranks computed as they wrote, then the rename) once they are done.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import RunDir, fsio
from areal_hpc.recover import Checkpoints, check_compatible, identity, save_into

logger = logging.getLogger("master")
CONTROLLER_FILE = "controller.json"
KILL_WAIT_S = 30  # Slurm's default KillWait: what a checkpoint written on SIGTERM has before SIGKILL


def write_time_warning(seconds: float, signal_grace_secs: int) -> str | None:
    """What to say when the shards of a checkpoint took longer to write than a checkpoint on a signal has."""
    if seconds <= min(KILL_WAIT_S, signal_grace_secs):
        return None
    return (
        f"the trainer ranks took {seconds:.0f} s to write this recover checkpoint; one written on SIGTERM has "
        f"Slurm's KillWait ({KILL_WAIT_S} s by default), one on USR2 the {signal_grace_secs} s of "
        "cluster.slurm.signal_grace_secs less the running step: raise signal_grace_secs, ask for a longer "
        "KillWait or GraceTime, or use more trainer ranks or faster storage (docs/troubleshooting.md)"
    )


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    def __init__(self, cfg: ExperimentConfig, run: RunDir, trainers, components: dict[str, Stateful]):
        self.cfg, self.run, self.trainers, self.components = cfg, run, trainers, components
        self.ckpts = Checkpoints(run.recover, cfg.recover_keep)

        self.pending: tuple[Path, int] | None = None  # the checkpoint being written: (folder, step)

    def save(self, step: int, wait: bool = False) -> Path | None:
        """Begin the checkpoint of `step` (after sealing the one before); with `wait`, seal it too (its path)."""
        self.finish(wait=True)
        tmp = self.ckpts.begin(step)
        self.trainers.call_all("recover_save", {"dir": str(tmp)})
        save_into(self.run, tmp)
        state = {name: c.state_dict() for name, c in self.components.items()}
        fsio.write_json(tmp / CONTROLLER_FILE, {"identity": identity(self.cfg), **state})
        self.pending = (tmp, step)
        return self.finish(wait=wait)

    def finish(self, wait: bool = True) -> Path | None:
        """Seal the pending checkpoint once the trainer ranks wrote it (`wait`: until they have); its path, or
        None if none was pending or, without `wait`, it is not written yet."""
        if self.pending is None:
            return None
        if not wait and not all(r["done"] for r in self.trainers.call_each("recover_poll")):
            return None
        tmp, step = self.pending
        ranks = self.trainers.call_all("recover_wait", {})
        known = {name: e for r in ranks for name, e in r["files"].items()}
        self.pending = None
        path = self.ckpts.commit(tmp, step, known)
        logger.info("Dumped recover info to file. (global step %d: %s)", step, path)
        seconds = max(r["write_s"] for r in ranks)
        logger.info("the trainer ranks wrote their shards in %.1f s (the slowest)", seconds)
        if warning := write_time_warning(seconds, self.cfg.cluster.slurm.signal_grace_secs):
            logger.warning(warning)
        return path

    def load(self, path: Path) -> None:
        """Every component and trainer rank as checkpoint `path` holds them (the run directory is the caller's)."""
        state = fsio.read_json(path / CONTROLLER_FILE)
        check_compatible(state["identity"], self.cfg, str(path))
        self.trainers.call_all("recover_load", {"dir": str(path)})
        for name, component in self.components.items():
            component.load_state_dict(state[name])

    def has(self, step: int) -> bool:
        return step in self.ckpts.steps() or (self.pending is not None and self.pending[1] == step)
