"""Begin an attempt of a run: a fresh start, a Slurm requeue, a local restart or `submit --recover`.

    attempt=$(python -m areal_hpc.recover.attempt --run-dir "$AREAL_RUN_DIR")   # prints N; exit 3 if FINISHED

Every attempt gets its own log folder, `logs/attempt<N>` (N: the first free number), and starts from a run
directory without the coordination state of the attempt before: heartbeats, server addresses, the trainers'
rendezvous file and mailboxes would otherwise make the new roles talk to dead ones. The old status is kept in
the old attempt's log folder. What training made (ledger, statistics, checkpoints, the rollout store) is left
for the controller, which cuts it back to the checkpoint it resumes from (`recover.rewind`).
Run once per attempt, before any role starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from areal_hpc.control import RunDir

ATTEMPT_ENV = "AREAL_ATTEMPT"
EXIT_FINISHED = 3


class RunFinishedError(RuntimeError):
    """The run already finished: an attempt would redo nothing and must not start."""


def current_attempt() -> int:
    """The attempt this process belongs to (`AREAL_ATTEMPT`; 0 when unset)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def next_attempt(run: RunDir) -> int:
    n = 0
    while run.attempt_logs(n).exists():
        n += 1
    return n


def begin_attempt(run: RunDir) -> int:
    """Make the next attempt's log folder and clear the last attempt's coordination state; its number."""
    if run.finished.exists():
        raise RunFinishedError(f"{run.root} finished ({run.finished} exists); nothing to resume")
    attempt = next_attempt(run)
    run.attempt_logs(attempt).mkdir(parents=True)
    if attempt > 0 and run.status.exists():
        os.replace(run.status, run.attempt_logs(attempt - 1) / run.status.name)
    for folder in (run.heartbeats, run.gen_servers, run.mailboxes):
        shutil.rmtree(folder, ignore_errors=True)
    if run.dist_init.exists():
        run.dist_init.unlink()
    return attempt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="areal_hpc.recover.attempt", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    ns = parser.parse_args(argv)
    try:
        print(begin_attempt(RunDir(ns.run_dir.resolve())))
    except RunFinishedError as exc:
        print(f"areal-hpc: {exc}", file=sys.stderr)
        return EXIT_FINISHED
    return 0


if __name__ == "__main__":
    sys.exit(main())
