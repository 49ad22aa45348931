"""`areal-hpc submit`: validate, lay out, render, then (and only then) write the run directory and submit.

Everything that can be wrong with a config is found by `prepare` before a file is written or a job submitted;
`--dry-run` stops there and prints the plan and the scripts.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import fsio
from areal_hpc.launch import slurm
from areal_hpc.launch.plan import LaunchPlan, PlanError, launch_plan
from areal_hpc.launch.rundir import RunDir, create_run_dir, default_trial_name, run_dir_of
from areal_hpc.launch.sbatch import code_version, render


@dataclass(frozen=True)
class Submission:
    cfg: ExperimentConfig
    run: RunDir
    plan: LaunchPlan
    scripts: tuple[str, ...]  # one per job of the plan


def prepare(cfg: ExperimentConfig) -> Submission:
    """The whole submission, checked; writes nothing. Raises PlanError with the field to change."""
    cfg = dataclasses.replace(cfg, mode="slurm", trial_name=cfg.trial_name or default_trial_name())
    run = run_dir_of(cfg)
    if run.root.exists():
        raise PlanError(f"trial_name: run directory {run.root} already exists; choose another trial_name")
    plan = launch_plan(cfg, run.root)
    version = code_version()
    return Submission(cfg, run, plan, tuple(render(plan, job, cfg, version) for job in plan.jobs))


def describe(sub: Submission) -> str:
    """The plan in a few lines: jobs, components, steps."""
    lines = [f"run directory: {sub.run.root}", f"layout: {sub.plan.kind}"]
    for job in sub.plan.jobs:
        lines.append(f"job {job.name}:")
        for i, c in enumerate(job.components):
            where = f"partition {c.partition}" if c.partition else "the default partition"
            lines.append(
                f"  component {i} ({c.name}) on {where}: {c.nodes} node(s) x {c.gpus_per_node} GPU(s), "
                f"{c.cpus_per_node} CPUs, {c.mem_gb_per_node} GiB"
            )
            for s in c.steps:
                gpus = f"{s.gpus_per_node} GPU(s)/node" if s.gpus_per_node else "no GPU"
                lines.append(f"    step {s.role}: {s.ntasks} task(s) on {s.nodes} node(s), {gpus}")
    return "\n".join(lines)


def dry_run_text(sub: Submission) -> str:
    scripts = [
        f"# ---- sbatch script of job {job.name}\n{text}"
        for job, text in zip(sub.plan.jobs, sub.scripts, strict=True)
    ]
    return "\n".join([describe(sub), "", *scripts])


def submit(sub: Submission) -> list[str]:
    """Create the run directory, write the scripts, submit every job; returns the job ids.

    If a job fails to submit, the ones submitted before it are cancelled and the run directory is removed.
    """
    if shutil.which("sbatch") is None:
        raise slurm.SlurmError("sbatch is not on PATH: run `areal-hpc submit` on a Slurm login node")
    run = create_run_dir(sub.cfg)
    folder = run.root / "slurm"
    folder.mkdir(mode=0o700)
    job_ids: list[str] = []
    try:
        for job, text in zip(sub.plan.jobs, sub.scripts, strict=True):
            (folder / f"{job.name}.sh").write_text(text)
            job_ids.append(slurm.submit(folder, text).job_id)
    except slurm.SlurmError:
        if job_ids:
            slurm.cancel(job_ids)
        shutil.rmtree(run.root)  # made by this call and never run: the trial name stays free for a retry
        raise
    record = {
        "kind": sub.plan.kind,
        "submitted": time.time(),
        "jobs": [
            {"name": job.name, "job_id": jid, "components": [c.name for c in job.components]}
            for job, jid in zip(sub.plan.jobs, job_ids, strict=True)
        ],
    }
    fsio.write_json(jobs_path(run), record, fsync=True)
    return job_ids


def jobs_path(run: RunDir):
    """Where a submitted run records its Slurm jobs."""
    return run.root / "slurm" / "jobs.json"
