"""What a role process knows of its run, built once when it starts and passed to the role's entry point."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from areal_hpc.alloc import Allocation
from areal_hpc.config import ExperimentConfig
from areal_hpc.control.rundir import RunDir

SINGLE_ROLES = ("controller", "rollout")  # one process per run: named without a task number
LAUNCHER_ENV = "AREAL_LAUNCHER_PID"  # set by `areal-hpc run` for the roles it starts (they die with it)


def task_name(role: str, index: int) -> str:
    """`controller`, `rollout`, or the role and the task's index: `trainer0`, `gen_server1`."""
    return role if role in SINGLE_ROLES else f"{role}{index}"


@dataclass(frozen=True)
class RunContext:
    """The run (its directory, config and allocation) and this process's place in it."""

    run: RunDir
    cfg: ExperimentConfig  # loaded from the run directory and validated, once
    allocation: Allocation  # resolved once
    role: str
    index: int  # among the tasks of the role, from the job environment
    n_tasks: int
    attempt: int
    local: bool  # every role on this machine (`areal-hpc run`): servers listen on loopback only

    @property
    def name(self) -> str:
        return task_name(self.role, self.index)

    @property
    def bind_host(self) -> str:
        """The address a server of this role listens on."""
        return "127.0.0.1" if self.local else "0.0.0.0"

    @property
    def public_host(self) -> str:
        """The address other roles reach this process at."""
        return "127.0.0.1" if self.local else socket.gethostname()
