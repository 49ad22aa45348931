"""The one entry point of every role process: `python -m areal_hpc.launch.roles --run-dir D ROLE`.

The same command runs under `areal-hpc run` (local processes), submitit's LocalExecutor (`role_main`) and in a
Slurm step. It does what every role needs: its place from the job environment (submitit's JobEnvironment:
SLURM_PROCID under Slurm, SUBMITIT_LOCAL_* locally), never from the launcher's arguments; the run's config and
allocation, loaded once into a `RunContext`; logging, signals, the heartbeat of the single roles, and the run's
status and exit code when the role fails. The role itself lives in its stage and is named here by module, so
that this package imports no worker stage.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

from areal_hpc.config import ConfigError, InputError, allocation_of
from areal_hpc.control import (
    EXIT_PERMANENT,
    LAUNCHER_ENV,
    SINGLE_ROLES,
    Heartbeat,
    RunContext,
    RunDir,
    abort,
    timeline,
)
from areal_hpc.launch.plan import role_tasks
from areal_hpc.recover import EXIT_PREEMPTED, Preempted, RecoverError, current_attempt

# Each role's entry point, `run(ctx: RunContext)`, in its own stage.
ROLES = {
    "gen_server": "areal_hpc.gen.server_role",
    "trainer": "areal_hpc.train.role",
    "controller": "areal_hpc.master.role",
    "rollout": "areal_hpc.gen.rollout_role",
}
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class JobEnvironmentError(RuntimeError):
    """A role started outside any job environment, or with a task count that does not match the plan."""


# Failures that every attempt would repeat: the role exits EXIT_PERMANENT and the run is not restarted.
PERMANENT = (ConfigError, InputError, RecoverError, JobEnvironmentError)


def task_of_job() -> tuple[int, int, bool]:
    """(index, number of tasks, local) of this process in its step, from submitit's JobEnvironment; `local`:
    a local job (every role on this machine)."""
    import submitit

    try:
        env = submitit.JobEnvironment()
    except RuntimeError as exc:
        raise JobEnvironmentError(
            "no job environment: start roles with `areal-hpc run`, submitit or Slurm "
            f"(SUBMITIT_EXECUTOR={os.environ.get('SUBMITIT_EXECUTOR', '')!r}): {exc}"
        ) from exc
    return env.global_rank, env.num_tasks, env.cluster != "slurm"


def run_context(run: RunDir, role: str) -> RunContext:
    """The run as this process of `role` sees it; the task count must be the plan's."""
    index, n_tasks, local = task_of_job()
    cfg = run.load_config()
    allocation = allocation_of(cfg)
    planned = role_tasks(cfg, allocation).get(role, 0)
    if n_tasks != planned:
        raise JobEnvironmentError(
            f"the job started {n_tasks} {role} task(s), but allocation_mode {cfg.allocation_mode!r} of "
            f"{run.config} plans {planned}"
        )
    return RunContext(run, cfg, allocation, role, index, n_tasks, current_attempt(), local)


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )


def die_with_launcher() -> None:
    """`areal-hpc run` starts each role in a session of its own, so that Ctrl-C reaches the launcher alone;
    should the launcher be killed outright, its roles get SIGTERM (Linux's parent-death signal) instead of
    running on unsupervised."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def role_main(run_dir: str | os.PathLike, role: str) -> int:
    """Run one role until it ends; its exit code (0, EXIT_PREEMPTED, EXIT_PERMANENT or 1). The callable that
    every launcher starts."""
    run = RunDir(Path(run_dir))
    # SIGTERM from the launcher or Slurm: leave through the normal exit path so that finally-blocks run (the
    # controller and the trainers replace this to write a recover checkpoint first).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    die_with_launcher()
    # USR2: Slurm's notice of preemption or of the time limit. The controller checkpoints on it; no other
    # role may die of it (USR2's default action).
    signal.signal(signal.SIGUSR2, lambda *_: logging.warning("USR2: preemption or time limit notice"))
    name = role
    try:
        ctx = run_context(run, role)
        name = ctx.name
        setup_logging(ctx.cfg.logging.level, name)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")  # the job step's GPUs, for GPU binding issues
        logging.info("%s on %s, attempt %d%s", name, socket.gethostname(), ctx.attempt,
                     f", CUDA_VISIBLE_DEVICES={gpus}" if gpus else "")  # fmt: skip
        if ctx.cfg.logging.timeline:
            timeline.record(
                run.timeline_file(name, ctx.attempt), attempt=ctx.attempt, host=socket.gethostname()
            )
        # The controller beats for servers in a job of their own, the rollout role for the controller. A failure
        # is recorded (abort) before the heartbeat says "stopped", so that servers report its cause.
        with Heartbeat(run.heartbeats, name) if role in SINGLE_ROLES else contextlib.nullcontext():
            module = importlib.import_module(ROLES[role])
            # What is loaded by now (torch's and the other modules' objects: most of the heap) is left out of
            # every later garbage collection: a full one over it stopped a server 0.4 s, its answers waiting.
            gc.freeze()
            module.run(ctx)
    except SystemExit:
        raise
    except Preempted as exc:  # no failure: the next attempt resumes from the checkpoint just written
        logging.warning("Preempted: %s", exc)
        abort(run, f"Preempted: {exc}", name)
        return EXIT_PREEMPTED
    except BaseException as exc:
        setup_logging("INFO", name)  # a no-op once logging is set up
        permanent = isinstance(exc, PERMANENT)
        logging.error("%s failed%s:\n%s", name, " (not retried)" if permanent else "", traceback.format_exc())
        abort(run, f"{type(exc).__name__}: {exc}", name, permanent)
        return EXIT_PERMANENT if permanent else 1
    finally:
        timeline.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal_hpc.launch.roles")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("role", choices=sorted(ROLES))
    ns = parser.parse_args(argv)
    return role_main(ns.run_dir, ns.role)


if __name__ == "__main__":
    sys.exit(main())
