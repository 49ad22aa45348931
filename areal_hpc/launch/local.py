"""`areal-hpc run`: every role of a run as a local process, supervised until the run completes or fails.

Roles meet only through the run directory, HTTP and torch.distributed, exactly as under Slurm; this module
only starts them (the tasks `role_tasks` plans, as a Slurm job would), shows progress, and stops them all when
one fails, or on Ctrl-C, SIGTERM (`areal-hpc stop`, which finds this process by `RunDir.launcher`) or SIGHUP;
what they leave running (agent programs) goes with them (`processes.kill_adopted`). A failed attempt is
restarted up to `recover_retries` times (unless recover_mode is disabled, or the failure would repeat: bad
config or inputs), as a Slurm job requeues itself; the controller then resumes from the newest recover
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from areal_hpc import alloc
from areal_hpc.config import ExperimentConfig, allocation_of
from areal_hpc.control import (
    ABORTED,
    COMPLETE,
    LAUNCHER_ENV,
    RunDir,
    abort,
    create_run_dir,
    fsio,
    get_status,
    task_name,
)
from areal_hpc.launch import processes
from areal_hpc.launch.plan import role_tasks
from areal_hpc.launch.preflight import check_inputs
from areal_hpc.monitor import Progress
from areal_hpc.recover import ATTEMPT_ENV, begin_attempt

STOP_GRACE_SECS = 5.0
# -P: the installed package, as the launcher's; plain `-m` would put the working directory first on sys.path, and
# roles started in a folder holding another checkout would run its areal_hpc (the job script's roles do the same).
ROLE_MODULE = ("-P", "-m", "areal_hpc.launch.roles")
# The signals that stop a run as a failure does, and what the run says then; its exit code: 128 + the signal.
STOP_SIGNALS = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "stopped (SIGTERM)",  # `areal-hpc stop`, kill, a batch system
    signal.SIGHUP: "stopped (SIGHUP)",  # the terminal closed
}


@dataclass
class Role:
    name: str  # controller | rollout | gen_server<i> | trainer<r>
    argv: list[str]
    env: dict[str, str]  # the job environment the role reads its index from
    process: subprocess.Popen | None = None

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


def plan_roles(cfg: ExperimentConfig, run: RunDir) -> list[Role]:
    """The processes of a run: the tasks of every role that `role_tasks` plans, as a Slurm job starts them."""
    allocation = allocation_of(cfg)
    entry = [sys.executable, *ROLE_MODULE, "--run-dir", str(run.root)]
    return [
        Role(task_name(role, i), [*entry, role], task_env(i, n, task_gpus(allocation, role, i)))
        for role, n in role_tasks(cfg, allocation).items()
        for i in range(n)
    ]


def task_gpus(allocation: alloc.Allocation, role: str, index: int) -> tuple[int, ...]:
    """The GPUs a task sees: a server its tensor-parallel group, a trainer rank every training GPU (it picks
    its own by rank), the CPU roles none."""
    if role == "gen_server":
        return allocation.gen_tasks()[index][0].gpus
    return allocation.layout("actor_train").gpus if role == "trainer" else ()


def task_env(index: int, n_tasks: int, gpus: tuple[int, ...] = ()) -> dict[str, str]:
    """Task `index` of `n_tasks` on this node, in the variables of submitit's local JobEnvironment, seeing
    only its step's GPUs as a Slurm step would (all nodes of the allocation are this machine)."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": str(os.getpid()),
        "SUBMITIT_LOCAL_NTASKS": str(n_tasks),
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_GLOBALID": str(index),
        "SUBMITIT_LOCAL_LOCALID": str(index),
    }


def start(roles: list[Role], run: RunDir, attempt: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    env[ATTEMPT_ENV], env[LAUNCHER_ENV] = str(attempt), str(os.getpid())
    for role in roles:
        log = open(run.attempt_logs(attempt) / f"{role.name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        # A session of its own: the terminal's Ctrl-C reaches only this supervisor, which stops roles in order.
        role.process = subprocess.Popen(
            role.argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **role.env}, start_new_session=True
        )
        log.close()


def stop(roles: list[Role], own: set[int], grace: float = STOP_GRACE_SECS) -> None:
    """SIGTERM every live role, then SIGKILL what is left after `grace` seconds, and whatever the roles left
    running: every child of this process but the roles and `own` (those it had before)."""
    live = [r for r in roles if r.process is not None and r.exit_code is None]
    for role in live:
        _signal(role, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(r.exit_code is None for r in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for role in live:
        if role.exit_code is None:
            _signal(role, signal.SIGKILL)
            role.process.wait()
    processes.kill_adopted(own | {r.process.pid for r in roles if r.process})


def _signal(role: Role, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(role.process.pid, sig)


def log_tail(log: Path, n: int = 15) -> str:
    lines = log.read_text(errors="replace").splitlines()[-n:] if log.is_file() else []
    return "\n".join("    " + line for line in lines)


class StopSignals:
    """Notes the STOP_SIGNALS that come while in the block, for the supervisor to stop the roles in order (an
    exception raised in the handler could cut that stop short)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            # SIGINT even where ignored (a shell's background job), SIGHUP not (nohup ignores it on purpose).
            if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame) -> None:
        self.received = self.received or signum

    def outcome(self) -> tuple[int, str] | None:
        """(exit code, message) once a stop signal came, else None."""
        return None if self.received is None else (128 + self.received, STOP_SIGNALS[self.received])


def supervise(
    roles: list[Role], run: RunDir, attempt: int, progress: Progress, signals: StopSignals
) -> tuple[int, str]:
    """Wait until the controller finishes (0), any role fails (1) or a stop signal comes (128 + it); returns
    (exit code, message)."""
    controller = next(r for r in roles if r.name == "controller")
    while True:
        if stopped := signals.outcome():
            return stopped
        progress.update()
        status = get_status(run)
        logs = run.attempt_logs(attempt)
        if status is not None and status.state == ABORTED:
            return 1, failure_message(logs, status.role, f"{status.role} aborted the run: {status.reason}")
        failed = [r for r in roles if r.exit_code not in (None, 0)]
        if failed:
            role = failed[0]
            return 1, failure_message(
                logs, role.name, f"role {role.name} failed with exit code {role.exit_code}"
            )
        if controller.exit_code == 0:
            return 0, "completed"
        early = [r for r in roles if r.exit_code == 0 and r is not controller]
        if early and (status is None or status.state != COMPLETE):
            return 1, failure_message(
                logs, early[0].name, f"role {early[0].name} exited before the run finished"
            )
        time.sleep(0.2)


def failure_message(logs: Path, role: str, reason: str) -> str:
    log = logs / f"{role}.log"
    return f"{reason}\nlast lines of {log}:\n{log_tail(log)}"


def run_local(cfg: ExperimentConfig, out: TextIO | None = None) -> int:
    """Create the run directory, then run attempts until one completes, fails for good or is interrupted;
    0 only when the run completed."""
    out = out or sys.stdout
    check_inputs(cfg, here=True)
    run = create_run_dir(cfg)
    print(f"run directory: {run.root}", file=out)
    restarts = 0 if cfg.recover_mode == "disabled" else cfg.recover_retries
    # The record `areal-hpc stop` finds this process by, there only while it supervises the run.
    fsio.write_json(run.launcher, processes.identity(os.getpid()))
    try:
        with StopSignals() as signals, processes.adopting_orphans():
            for restart in range(restarts + 1):
                code, message = run_attempt(cfg, run, out, signals)
                status = get_status(run)
                if code == 0 or signals.received or restart == restarts or (status and status.permanent):
                    break
                print(f"areal-hpc run: {message.splitlines()[0]}; restarting in {cfg.recover_after} s "
                      f"(restart {restart + 1} of {restarts})", file=sys.stderr)  # fmt: skip
                pause(cfg.recover_after, signals)
                if signals.received:
                    code, message = signals.outcome()
                    break
    finally:
        run.launcher.unlink(missing_ok=True)
    if code == 1 and status is not None and status.permanent:  # a failure, not a stop signal
        message += "\nnot restarted: a new attempt would fail alike (fix the config or the inputs)"
    print(f"areal-hpc run: {message}", file=out if code == 0 else sys.stderr)
    return code


def pause(secs: float, signals: StopSignals) -> None:
    """Sleep `secs` seconds, or less when a stop signal comes."""
    deadline = time.monotonic() + secs
    while not signals.received and time.monotonic() < deadline:
        time.sleep(0.1)


def run_attempt(cfg: ExperimentConfig, run: RunDir, out: TextIO, signals: StopSignals) -> tuple[int, str]:
    """Start every role of a new attempt and supervise them until the run completes, the attempt fails or a
    stop signal comes."""
    attempt = begin_attempt(run)
    roles = plan_roles(cfg, run)
    print(f"attempt {attempt}: roles {', '.join(r.name for r in roles)} (logs in {run.attempt_logs(attempt)})",
          file=out)  # fmt: skip
    progress = Progress(run, out if cfg.logging.progress else None)
    own = set(processes.children(os.getpid()))  # a caller's own children (a test's), never killed here
    code, message = 1, "the launcher failed"  # should start or supervise raise: the roles stop all the same
    try:
        start(roles, run, attempt)
        code, message = supervise(roles, run, attempt, progress, signals)
    finally:
        if code != 0:
            abort(run, message.splitlines()[0], "launcher")  # keeps the first cause if a role set one
        stop(roles, own)
        progress.finish()
    return code, message
