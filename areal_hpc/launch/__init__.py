"""Launching: the plan of a run's roles, their one entry point, `areal-hpc run` (local processes) and
`areal-hpc submit` (one Slurm job), and the runs as a user sees them. It starts roles by module name and
imports no worker stage.

plan       the roles and tasks of a run, laid out as Slurm jobs, components and steps (pure)
preflight  the inputs a config names, checked before anything is written or submitted
roles      the entry point of every role process (job environment, RunContext, signals, exit codes)
local      `areal-hpc run`: every role as a local process, supervised, restarted after a fault
sbatch     the job script of a plan (slurm_templates/job.sh.j2; pure)
slurm      submitit with heterogeneous jobs; sacct, scancel
submit     `areal-hpc submit` and `submit --recover`
runs       find, list, stop, logs of submitted runs
run_status what `areal-hpc status` shows of a run, once or live (--watch)
"""

from areal_hpc.launch import run_status, runs, submit
from areal_hpc.launch.local import run_local

__all__ = ["run_local", "run_status", "runs", "submit"]
