"""`areal-hpc submit`: validate, lay out, render, then (and only then) write the run directory and submit.

Everything that can be wrong with a config is found by `prepare` before a file is written or a job submitted;
`--dry-run` stops there and prints the plan and the scripts.

`areal-hpc submit --recover RUN` submits an existing run again from its own config.yaml (`prepare_recover`
checks that it may, `submit` appends the new jobs to `slurm/jobs.json`); the new attempt resumes from the
newest recover checkpoint as recover_mode says.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import RunDir, create_run_dir, default_trial_name, fsio, run_dir_of
from areal_hpc.launch import slurm
from areal_hpc.launch.plan import LaunchPlan, PlanError, launch_plan
from areal_hpc.launch.preflight import check_inputs
from areal_hpc.launch.runs import slurm_jobs
from areal_hpc.launch.sbatch import code_version, render
from areal_hpc.recover import Checkpoints, RecoverError, begin_attempt, next_attempt, resumes


class RecoverRefused(ValueError):
    """A run that `submit --recover` must not submit again; the message names the run and why."""


@dataclass(frozen=True)
class Submission:
    cfg: ExperimentConfig
    run: RunDir
    plan: LaunchPlan
    scripts: tuple[str, ...]  # one per job of the plan
    attempt: int = 0  # the attempt it starts (a two-job run's scripts run this one; the others begin it)
    recover: bool = False  # an existing run submitted again
    requeue: tuple[str, ...] = ()  # recover by requeueing these stuck jobs (slurm.stuck) instead


def prepare(cfg: ExperimentConfig) -> Submission:
    """The whole submission, checked (config, inputs, layout); writes nothing. Raises PlanError or InputError
    naming the field to change."""
    check_inputs(cfg)
    cfg = dataclasses.replace(cfg, trial_name=cfg.trial_name or default_trial_name())
    run = run_dir_of(cfg)
    if run.root.exists():
        raise PlanError(f"trial_name: run directory {run.root} already exists; choose another trial_name")
    plan = launch_plan(cfg, run)
    version = code_version()
    return Submission(cfg, run, plan, tuple(render(plan, job, cfg, version) for job in plan.jobs))


def prepare_recover(run: RunDir) -> Submission:
    """The resubmission of an existing run, with the plan of its own config.yaml, checked; writes nothing.

    Raises RecoverRefused when the run finished, still has a Slurm job pending or running, has recovery
    disabled, or must resume (recover_mode resume) but holds no valid recover checkpoint.
    """
    cfg = run.load_config()
    record = fsio.read_json(run.jobs)
    stuck = tuple(j["job_id"] for j in slurm_jobs(run) if slurm.stuck(slurm.component_states(j["job_id"])))
    check_recoverable(run, cfg, record, ignore=stuck)
    check_inputs(cfg, new_run=False)
    # The original submission's working directory: relative paths of the config resolve there.
    plan = launch_plan(cfg, run, workdir=Path(record.get("workdir") or Path.cwd()))
    attempt = next_attempt(run)
    if stuck:  # the job itself can run again: its script begins the next attempt
        return Submission(cfg, run, plan, (), attempt, recover=True, requeue=stuck)
    version = code_version()
    scripts = tuple(render(plan, job, cfg, version, attempt) for job in plan.jobs)
    return Submission(cfg, run, plan, scripts, attempt, recover=True)


def check_recoverable(
    run: RunDir, cfg: ExperimentConfig, record: dict | None, ignore: tuple[str, ...] = ()
) -> None:
    """RecoverRefused naming the first reason why `run` must not be submitted again (jobs in `ignore` may be
    live: they are stuck, and recovered by a requeue)."""

    def refuse(why: str) -> NoReturn:
        raise RecoverRefused(f"cannot recover {run.root}: {why}")

    if run.finished.exists():
        refuse(f"it finished ({run.finished.name} exists); there is nothing to resume")
    if not record:
        refuse(f"it was not submitted to Slurm (no {run.jobs}); `areal-hpc run` restarts local runs")
    jobs = [j for j in record["jobs"] if j["job_id"] not in ignore]
    for component, state in live_components(jobs).items():  # the first one is enough
        refuse(f"its Slurm job {component} has not ended ({state}); stop it first: areal-hpc stop {run.root}")
    if cfg.recover_mode == "disabled":
        refuse("recover_mode is disabled in its config.yaml (no recover checkpoints); start a new trial")
    ckpts = Checkpoints(run.recover)
    try:
        resumes(cfg.recover_mode, next_attempt(run), ckpts.latest() is not None, str(ckpts.root))
    except RecoverError as exc:
        refuse(str(exc))


def live_components(jobs: list[dict]) -> dict[str, str]:
    """{component id: state} of the recorded jobs that may still run (pending, running, requeued)."""
    live = {}
    for job in jobs:
        states = slurm.component_states(job["job_id"])
        if not states:  # sacct knows a job a moment after sbatch returns, and forgets purged ones
            state = slurm.controller_state(job["job_id"])
            states = {job["job_id"]: f"{state}, not in sacct yet"} if state else {}
        live |= {k: v for k, v in states.items() if v.split(",")[0] not in slurm.FINAL_STATES}
    return live


def describe(sub: Submission) -> str:
    """The plan in a few lines: jobs, components, steps."""
    lines = [f"run directory: {sub.run.root}", f"layout: {sub.plan.kind}"]
    if sub.recover:
        lines.append(f"recover: attempt {sub.attempt}, recover_mode {sub.cfg.recover_mode}")
    if sub.requeue:
        lines.append(
            f"requeue: job {', '.join(sub.requeue)} is stuck (a node of component 0 failed, Slurm requeued that "
            "component alone): `scontrol requeue` starts every component again"
        )
        return "\n".join(lines)
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
    if sub.requeue:
        return describe(sub) + "\n"
    scripts = [
        f"# ---- sbatch script of job {job.name}\n{text}"
        for job, text in zip(sub.plan.jobs, sub.scripts, strict=True)
    ]
    return "\n".join([describe(sub), "", *scripts])


def submit(sub: Submission) -> list[str]:
    """Create the run directory (or reuse it, to recover), write the scripts, submit every job; the job ids.

    If a job fails to submit, the ones submitted before it are cancelled; a run directory made by this call
    is removed.
    """
    if shutil.which("sbatch") is None:
        raise slurm.SlurmError("sbatch is not on PATH: run `areal-hpc submit` on a Slurm login node")
    if sub.requeue:
        slurm.requeue(list(sub.requeue))
        return list(sub.requeue)
    if sub.recover:
        begin_two_jobs_attempt(sub)
        job_ids = submit_jobs(sub)
    else:
        run = create_run_dir(sub.cfg)
        run.slurm.mkdir(mode=0o700)
        try:
            begin_two_jobs_attempt(sub)
            job_ids = submit_jobs(sub)
        except slurm.SlurmError:
            shutil.rmtree(run.root)  # made by this call and never run: the trial name stays free for a retry
            raise
    record(sub, job_ids)
    return job_ids


def begin_two_jobs_attempt(sub: Submission) -> None:
    """A two-job run's attempt begins here, once: each job beginning its own would clear the other's state."""
    if sub.plan.kind != "two-jobs":
        return  # the job script begins it
    attempt = begin_attempt(sub.run)
    if attempt != sub.attempt:  # another attempt began since `prepare_recover` looked
        raise RecoverRefused(
            f"cannot recover {sub.run.root}: attempt {attempt} began, not {sub.attempt}; try again"
        )


def submit_jobs(sub: Submission) -> list[str]:
    """Write and submit the scripts in order; if one is refused, cancel those submitted before it."""
    folder = sub.run.slurm
    job_ids: list[str] = []
    try:
        for job, text in zip(sub.plan.jobs, sub.scripts, strict=True):
            (folder / f"{job.name}.sh").write_text(text)
            job_ids.append(slurm.submit(folder, text).job_id)
    except slurm.SlurmError:
        if job_ids:
            slurm.cancel(job_ids)
        raise
    return job_ids


def record(sub: Submission, job_ids: list[str]) -> None:
    """Add the submitted jobs to `slurm/jobs.json`, after those of earlier submissions of the run."""
    old = fsio.read_json(sub.run.jobs) or {"jobs": []}
    submission = 1 + max((j.get("submission", 0) for j in old["jobs"]), default=-1)
    now = time.time()
    new = [
        {"name": job.name, "job_id": jid, "components": [c.name for c in job.components],
         "submission": submission, "submitted": now}
        for job, jid in zip(sub.plan.jobs, job_ids, strict=True)
    ]  # fmt: skip
    rec = {
        "kind": sub.plan.kind,
        "workdir": old.get("workdir", str(sub.plan.workdir)),
        "submitted": old.get("submitted", now),
        "jobs": old["jobs"] + new,
    }
    fsio.write_json(sub.run.jobs, rec, fsync=True)
