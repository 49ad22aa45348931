"""An evaluation as a job of its own (`areal-hpc eval --submit`, and each checkpoint under eval.enabled):
submitit's SlurmExecutor on the generation partition, or its LocalExecutor for a run of local processes."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import submitit

from areal_hpc.config import ExperimentConfig


def make_executor(cfg: ExperimentConfig, folder: Path, local: bool, n_gpus: int | None = None):
    """Where an evaluation job runs: a local process, or a Slurm job on the generation partition with
    `n_gpus` (default eval.n_gpus) and cfg.cluster.slurm's account, QoS, setup commands..."""
    ev, slurm = cfg.eval, cfg.cluster.slurm
    n_gpus = n_gpus or ev.n_gpus
    if local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=ev.time_limit_mins)
        return executor
    python = slurm.python or sys.executable
    executor = submitit.SlurmExecutor(folder=folder, python=f"{slurm.command_prefix or ''} {python}".strip())
    extra = {k: v for k, v in (("account", slurm.account), ("qos", slurm.qos)) if v}
    for line in slurm.extra_sbatch_lines:  # '--reservation=x', '--exclusive'
        key, _, value = line.strip().removeprefix("--").partition("=")
        extra[key] = value or True
    executor.update_parameters(
        partition=slurm.gen_partition, time=ev.time_limit_mins, nodes=1, ntasks_per_node=1,
        gpus_per_node=n_gpus, cpus_per_task=slurm.cpus_per_gpu * n_gpus, mem=f"{slurm.mem_per_gpu_gb * n_gpus}G",
        constraint=slurm.constraint, exclude=slurm.exclude, setup=list(slurm.setup_commands),
        job_name=f"{cfg.experiment_name}-eval", additional_parameters=extra,
    )  # fmt: skip
    return executor


@contextlib.contextmanager
def outside_this_job():
    """The environment without this job's Slurm variables (SLURM_CONF kept): sbatch and the new job's srun
    would take them for their own (a heterogeneous job's make srun refuse to start)."""
    saved = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"
    }
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)
