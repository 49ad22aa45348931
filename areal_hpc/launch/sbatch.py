"""sbatch script text of a launch plan, from the Jinja2 template in slurm_templates/. Pure: no file is written.

The template is package data (areal_hpc/launch/slurm_templates/), so that an installed wheel renders it too; the
checkout's top-level slurm_templates/ links to it.
"""

from __future__ import annotations

import functools
import shlex
import subprocess
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import jinja2

from areal_hpc.config import ExperimentConfig
from areal_hpc.control import EXIT_PERMANENT
from areal_hpc.launch.plan import Job, LaunchPlan, Step
from areal_hpc.recover import EXIT_PREEMPTED


def srun_options(step: Step) -> str:
    """The resources of one step; `--kill-on-bad-exit` ends the step when any of its tasks fails."""
    opts = [f"--het-group={step.het_group}"] if step.het_group is not None else []
    opts += [f"--nodes={step.nodes}", f"--ntasks={step.ntasks}", f"--ntasks-per-node={step.ntasks_per_node}"]
    opts += [f"--cpus-per-task={step.cpus_per_task}"]
    opts += [f"--gpus-per-node={step.gpus_per_node}"] if step.gpus_per_node else []
    if step.overlap:
        opts.append("--overlap")
    opts.append("--kill-on-bad-exit=1")
    return " ".join(opts)


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("areal_hpc.launch", "slurm_templates"),  # package data, also in a wheel
        undefined=jinja2.StrictUndefined,  # a typo in the template fails loudly, not as an empty string
        keep_trailing_newline=True,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["srun_options"] = srun_options
    return env


def render(plan: LaunchPlan, job: Job, cfg: ExperimentConfig, version: str, attempt: int = 0) -> str:
    """The sbatch script of one job of `plan`.

    A hetjob or single-job script begins each attempt itself (also after a requeue). The two jobs of a two-job
    run must not: `areal-hpc submit` begins `attempt` before submitting them, and the script runs that one.
    """
    prefix = plan.command_prefix.strip()
    return (
        _environment()
        .get_template("job.sh.j2")
        .render(
            job=job,
            kind=plan.kind,
            version=version,
            run=plan.run,
            # A path of the run directory as the script names it: "$AREAL_RUN_DIR/...".
            in_run=lambda path: f'"$AREAL_RUN_DIR/{Path(path).relative_to(plan.run.root)}"',
            workdir=plan.workdir,
            slurm=asdict(cfg.cluster.slurm),
            setup_commands=plan.setup_commands,
            command_prefix=prefix + " " if prefix else "",
            python=plan.python,
            begins_attempt=plan.kind != "two-jobs",
            attempt=attempt,
            recover={
                "mode": cfg.recover_mode,
                "retries": cfg.recover_retries,
                "after": cfg.recover_after,
                "preempted_code": EXIT_PREEMPTED,
                "permanent_code": EXIT_PERMANENT,
            },
        )
    )


def code_version() -> str:
    """The package version, plus the git commit when running from a checkout (`+dirty` with local changes)."""
    version = metadata.version("areal_hpc")
    root = Path(__file__).resolve().parents[2]
    # An installed package has no .git beside it; a repository around its venv is not its source.
    if not (root / ".git").exists():
        return version
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty=+dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version}-{commit}" if commit else version
