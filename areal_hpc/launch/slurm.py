"""Slurm through submitit: submit our own sbatch text (heterogeneous jobs), read states, cancel.

submitit has no heterogeneous-job support (its issue 1741). Two changes make it work:
- the submission file is the script rendered by `sbatch.render` (the roles run `areal_hpc.launch.roles`
  directly, so no pickled callable is needed and `Job.result()` is not used);
- sacct reports a heterogeneous job as rows `N+0`, `N+1`: the watcher files row `N+0` under job `N` as well,
  so that submitit's Job state is right.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

# Slurm states after which a job no longer runs (a requeued job goes back to PENDING and is not final).
FINAL_STATES = (
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
)  # fmt: skip


class SlurmError(RuntimeError):
    """A Slurm command failed; the message holds the command and its output."""


class HetInfoWatcher(SlurmInfoWatcher):
    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        for key, stats in list(info.items()):
            if key.endswith("+0"):  # the leader component holds the batch script: its state is the job's
                info[key[:-2]] = stats
        return info


class HetJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=5)

    def component_state(self, index: int) -> str:
        """State of component `index` of a heterogeneous job (`UNKNOWN` until sacct knows it)."""
        self.watcher.get_state(self.job_id, mode="force")
        return self.watcher.get_info(f"{self.job_id}+{index}", mode="cache").get("State") or "UNKNOWN"


class ScriptExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor submitting a ready script: sbatch call, job id, job folder, Job object."""

    job_class = HetJob

    def __init__(self, folder: Path, script: str) -> None:
        super().__init__(folder=folder)
        self._script = script

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return 1

    def submit_script(self) -> HetJob:
        try:
            return self._submit_command("")
        except (submitit.core.utils.FailedJobError, OSError) as exc:
            raise SlurmError(f"sbatch failed: {exc}") from exc


def submit(folder: Path, script: str) -> HetJob:
    """Submit `script` with its submitit job files in `folder`."""
    return ScriptExecutor(folder, script).submit_script()


def job(folder: Path, job_id: str) -> HetJob:
    """The submitit Job of an already submitted job."""
    return HetJob(folder=folder, job_id=job_id)


def component_states(job_id: str) -> dict[str, str]:
    """{"N+0": state, "N+1": state} of a heterogeneous job, {"N": state} of a plain one; {} if unknown."""
    out = _run(["sacct", "-j", job_id, "-X", "-n", "--parsable2", "-o", "JobID,State"])
    states = {}
    for line in out.splitlines():
        job_id_field, _, state = line.partition("|")
        states[job_id_field] = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    het = {k: v for k, v in states.items() if "+" in k}
    return het or states


def stuck(states: dict[str, str]) -> bool:
    """A heterogeneous job that can never start: after the node of its leader (component 0) failed, Slurm
    22.05 requeues that component alone and keeps the others failed, so the job pends for good. `scontrol
    requeue` of the leader requeues every component (`areal-hpc submit --recover` does it)."""
    het = [state for component, state in states.items() if "+" in component]
    return "PENDING" in het and any(state in FINAL_STATES for state in het)


def requeue(job_ids: list[str]) -> None:
    """Requeue jobs; for a stuck heterogeneous job scontrol says the leader is pending, and does it anyway."""
    subprocess.run(["scontrol", "requeue", *job_ids], capture_output=True, text=True, timeout=60)


def controller_state(job_id: str) -> str | None:
    """The job's state as slurmctld holds it (pending, running, or ended within MinJobAge), None once it
    forgot the job: what to ask while sacct does not know a job yet."""
    done = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60
    )
    match = re.search(r"\bJobState=(\S+)", done.stdout) if done.returncode == 0 else None
    return match.group(1) if match else None


def cancel(job_ids: list[str]) -> None:
    _run(["scancel", *job_ids])


def wait_final(job_ids: list[str], timeout: float) -> dict[str, str]:
    """Poll sacct until every component of `job_ids` is in a final state; raises TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        per_job = [component_states(j) for j in job_ids]
        states = {k: v for job in per_job for k, v in job.items()}
        # A job sacct does not list yet has not ended: every job must be known before we return.
        if all(per_job) and all(s in FINAL_STATES for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {', '.join(job_ids)} still not ended after {timeout:.0f} s: {states}")
        time.sleep(0.5)


def _run(cmd: list[str], timeout: float = 60) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{' '.join(cmd)}: {exc}") from exc
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout
