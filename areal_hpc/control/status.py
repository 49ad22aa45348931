"""Experiment status (``RunDir.status``): RUNNING, then COMPLETE or ABORTED, which are final; and whether a
run is over for the roles that serve it.

``{"state": ..., "reason": ..., "role": ..., "time": <unix time>, "host": ...}``. Leaving a final state needs
``reset=True`` (recovery). ``complete`` also writes the FINISHED marker (``RunDir.finished``). ``abort`` keeps
the first cause when several roles fail one after another. The check and the write are not one atomic step;
the controller is the usual writer and other roles only abort.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass

from areal_hpc.control import fsio
from areal_hpc.control.heartbeat import last_beat
from areal_hpc.control.rundir import RunDir

RUNNING = "RUNNING"
COMPLETE = "COMPLETE"
ABORTED = "ABORTED"
STATES = (RUNNING, COMPLETE, ABORTED)
FINAL_STATES = (COMPLETE, ABORTED)
START_TIMEOUT_SECS = 600.0  # the longest a role waits for the others to start (model loads included)
CONTROLLER_DEAD_SECS = 60.0  # a controller silent this long is gone
# The exit code of a role that failed in a way every attempt would repeat (EX_CONFIG): bad config or inputs, a
# checkpoint that cannot be resumed. The launchers end the run instead of starting another attempt.
EXIT_PERMANENT = 78


class StatusError(RuntimeError):
    """A status change that is not allowed (leaving a final state without reset, an unknown state)."""


class RunEndedError(RuntimeError):
    """The run ended without completing while a role was serving it (see `why_stop`)."""


@dataclass(frozen=True)
class Status:
    """The state of an experiment, why, which role set it and when (unix time)."""

    state: str
    reason: str = ""
    role: str = ""
    time: float = 0.0
    host: str = ""
    permanent: bool = False  # ABORTED by a failure that a new attempt would repeat (config, inputs)

    @property
    def final(self) -> bool:
        """True for COMPLETE and ABORTED."""
        return self.state in FINAL_STATES


def get_status(run: RunDir) -> Status | None:
    """The current status, or None before anything was written."""
    data = fsio.read_json(run.status)
    if data is None:
        return None
    return Status(**{k: v for k, v in data.items() if k in Status.__dataclass_fields__})


def set_status(
    run: RunDir, state: str, *, reason: str = "", role: str = "", reset: bool = False, permanent: bool = False
) -> Status:
    """Write ``state``; raises StatusError when the run is already COMPLETE or ABORTED, unless ``reset``."""
    if state not in STATES:
        raise StatusError(f"unknown experiment state {state!r}; use one of {', '.join(STATES)}")
    current = get_status(run)
    if current is not None and current.final and not reset:
        raise StatusError(
            f"{run.status}: cannot set {state}: the run is already {current.state} "
            f"(by {current.role or '?'}: {current.reason or 'no reason'}); pass reset=True to recover"
        )
    new = Status(state, reason, role, time.time(), socket.gethostname(), permanent)
    fsio.write_json(run.status, asdict(new), fsync=True)
    return new


def abort(run: RunDir, reason: str, role: str, permanent: bool = False) -> Status:
    """Mark the run ABORTED by ``role`` for ``reason`` (``permanent``: no new attempt would fare better); if it
    is already final, keep that and return it."""
    current = get_status(run)
    if current is not None and current.final:
        return current
    return set_status(run, ABORTED, reason=reason, role=role, permanent=permanent)


def complete(run: RunDir, role: str, reason: str = "finished") -> Status:
    """Mark the run COMPLETE and write FINISHED; raises StatusError if it was already final."""
    status = set_status(run, COMPLETE, reason=reason, role=role)
    fsio.write_json(run.finished, asdict(status), fsync=True)
    return status


def why_stop(run: RunDir, waited: float, dead_secs: float = CONTROLLER_DEAD_SECS) -> str | None:
    """For a role that serves the run (a generation server, the rollout role): None while the run goes on;
    "" once it finished; else why to give up on it. `waited`: seconds since the role started."""
    if run.finished.exists():
        return ""
    status = get_status(run)
    if status is not None and status.state == ABORTED:
        return f"the run was aborted by {status.role or '?'}: {status.reason}"
    beat = last_beat(run.heartbeats, "controller")
    if beat is None:
        return (
            f"no controller started within {START_TIMEOUT_SECS:.0f} s"
            if waited > START_TIMEOUT_SECS
            else None
        )
    if beat.get("state") == "stopped":
        return "the controller stopped before the run finished"
    age = time.time() - beat["time"]
    return f"the controller's last heartbeat is {age:.0f} s old" if age > dead_secs else None
