"""The run directory: where every role of one run finds the others (layout in docs/architecture.md)."""

from __future__ import annotations

import getpass
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import ExperimentConfig, dump_yaml, load_config


@dataclass(frozen=True)
class RunDir:
    """Paths of one run's directory; creating it is `create_run_dir`'s job, every role only reads these."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def attempt_logs(self, attempt: int) -> Path:
        """Role logs of one attempt (a requeued Slurm job or a restarted local run starts a new one)."""
        return self.logs / f"attempt{attempt}"

    @property
    def stats(self) -> Path:
        return self.logs / "stats.jsonl"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    def step_data(self, step: int) -> Path:
        return self.root / "data" / f"step{step}"

    def weights(self, version: int) -> Path:
        return self.root / "weights" / f"v{version}"

    def checkpoint(self, role: str, epoch: int, epoch_step: int, global_step: int) -> Path:
        name = f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"
        return self.root / "checkpoints" / role / name

    @property
    def published_version(self) -> Path:
        """{"version": N}: the weight version the servers hold, written after each publication (async)."""
        return self.root / "version.json"

    @property
    def start_point(self) -> Path:
        """{"attempt", "global_step", "version"}: where the current attempt starts, written by the controller
        once it resumed (or started afresh); the rollout role waits for it."""
        return self.root / "start.json"

    def gen_address(self, index: int) -> Path:
        return self.root / "gen_servers" / f"{index}.json"

    @property
    def dist_init(self) -> Path:
        return self.root / "dist_init"

    def load_config(self) -> ExperimentConfig:
        return load_config([self.config])

    def token(self) -> str:
        return self.secret.read_text().strip()


def default_trial_name(now: float | None = None) -> str:
    """`run<timestamp>`, the original's default trial name."""
    return "run" + time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def run_dir_of(cfg: ExperimentConfig) -> RunDir:
    """<fileroot>/<user>/<experiment>/<trial> of a config whose trial name is set."""
    if cfg.trial_name is None:
        raise ValueError("trial_name must be set before the run directory is known")
    root = Path(cfg.cluster.fileroot).expanduser().resolve()
    return RunDir(root / getpass.getuser() / cfg.experiment_name / cfg.trial_name)


def create_run_dir(cfg: ExperimentConfig) -> RunDir:
    """Make the run directory (0700) with the resolved config and a fresh secret token (0600).

    An existing run directory is an error: a trial name names one run (resuming is the recover path).
    """
    run = run_dir_of(cfg)
    if run.root.exists():
        raise FileExistsError(f"run directory {run.root} already exists; choose another trial_name")
    run.root.mkdir(parents=True, mode=0o700)
    run.logs.mkdir(mode=0o700)
    fd = os.open(run.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    tmp = run.config.with_suffix(".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(run.config)
    return run
