"""`areal-hpc run`: every role of a run as a local process, supervised until the run completes or fails.

Roles meet only through the run directory, HTTP and torch.distributed, exactly as under Slurm; this module
only starts them, shows progress, and stops them all when one fails or the user presses Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from areal_hpc import alloc
from areal_hpc.config import ExperimentConfig
from areal_hpc.control.status import ABORTED, COMPLETE, abort, get_status
from areal_hpc.launch.rundir import RunDir, create_run_dir
from areal_hpc.monitor.progress import Progress

STOP_GRACE_SECS = 5.0


@dataclass
class Role:
    name: str  # controller | gen_server<i> | trainer<r>
    argv: list[str]
    env: dict[str, str]  # the job environment the role reads its index from
    process: subprocess.Popen | None = None

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


def plan_roles(cfg: ExperimentConfig, run: RunDir) -> list[Role]:
    """The processes of a run: one generation server per TP group, one trainer per rank, the controller."""
    allocation = alloc.resolve_allocation(
        cfg.allocation_mode, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    )
    servers = allocation.gen_servers()  # one per TP group of the generation layout
    entry = [sys.executable, "-m", "areal_hpc.launch.roles", "--run-dir", str(run.root)]
    roles = [
        Role(f"gen_server{i}", [*entry, "gen_server"], task_env(i, len(servers), s.gpus))
        for i, s in enumerate(servers)
    ]
    n_trainers, train_gpus = allocation.n_train_gpus, allocation.layout("actor_train").gpus
    roles += [
        Role(f"trainer{r}", [*entry, "trainer"], task_env(r, n_trainers, train_gpus))
        for r in range(n_trainers)
    ]
    if cfg.async_rl and cfg.experiment_type == "ppo":
        roles.append(Role("rollout", [*entry, "rollout"], task_env(0, 1)))
    roles.append(Role("controller", [*entry, "controller"], task_env(0, 1)))
    return roles


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


def start(roles: list[Role], run: RunDir) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    for role in roles:
        log = open(run.attempt_logs(0) / f"{role.name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        # A session of its own: the terminal's Ctrl-C reaches only this supervisor, which stops roles in order.
        role.process = subprocess.Popen(
            role.argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **role.env}, start_new_session=True
        )
        log.close()


def stop(roles: list[Role], grace: float = STOP_GRACE_SECS) -> None:
    """SIGTERM every live role, then SIGKILL what is left after `grace` seconds."""
    live = [r for r in roles if r.exit_code is None]
    for role in live:
        _signal(role, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(r.exit_code is None for r in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for role in live:
        if role.exit_code is None:
            _signal(role, signal.SIGKILL)
            role.process.wait()


def _signal(role: Role, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(role.process.pid, sig)


def log_tail(run: RunDir, role: str, n: int = 15) -> str:
    path = run.attempt_logs(0) / f"{role}.log"
    lines = path.read_text(errors="replace").splitlines()[-n:] if path.is_file() else []
    return "\n".join("    " + line for line in lines)


def supervise(roles: list[Role], run: RunDir, progress: Progress) -> tuple[int, str]:
    """Wait until the controller finishes (0) or any role fails (1); returns (exit code, message)."""
    controller = next(r for r in roles if r.name == "controller")
    while True:
        progress.update()
        status = get_status(run.root)
        if status is not None and status.state == ABORTED:
            return 1, failure_message(run, status.role, f"{status.role} aborted the run: {status.reason}")
        failed = [r for r in roles if r.exit_code not in (None, 0)]
        if failed:
            role = failed[0]
            return 1, failure_message(
                run, role.name, f"role {role.name} failed with exit code {role.exit_code}"
            )
        if controller.exit_code == 0:
            return 0, "completed"
        early = [r for r in roles if r.exit_code == 0 and r is not controller]
        if early and (status is None or status.state != COMPLETE):
            return 1, failure_message(
                run, early[0].name, f"role {early[0].name} exited before the run finished"
            )
        time.sleep(0.2)


def failure_message(run: RunDir, role: str, reason: str) -> str:
    return f"{reason}\nlast lines of {run.attempt_logs(0) / (role + '.log')}:\n{log_tail(run, role)}"


def run_local(cfg: ExperimentConfig, out: TextIO | None = None) -> int:
    """Create the run directory, start every role, supervise them; 0 only when the run completed."""
    out = out or sys.stdout
    run = create_run_dir(cfg)
    roles = plan_roles(cfg, run)
    print(f"run directory: {run.root}", file=out)
    run.attempt_logs(0).mkdir()
    print(f"roles: {', '.join(r.name for r in roles)} (logs in {run.attempt_logs(0)})", file=out)
    progress = Progress(run, out)
    try:
        start(roles, run)
        code, message = supervise(roles, run, progress)
    except KeyboardInterrupt:
        code, message = 130, "interrupted (Ctrl-C)"
    if code != 0:
        abort(run.root, message.splitlines()[0], "launcher")  # keeps the first cause if a role set one
    stop(roles)
    progress.finish()
    print(f"areal-hpc run: {message}", file=out if code == 0 else sys.stderr)
    return code
