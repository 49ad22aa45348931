"""How a notice stops the controller, in one place.

USR2 (preemption or the time limit ahead): the step under way finishes, a recover checkpoint is written, the
controller stops (`Preempted`). SIGTERM (scancel, requeue, preemption now): the step under way is given up
unless its update began, since the servers and the rollout role stop at once; the last finished step is
checkpointed (the trainers serve on for it) and the controller stops. An update under way is finished without
publishing (a resume republishes), then checkpointed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from areal_hpc.recover import Interrupted, Preempted, PreemptNotice

logger = logging.getLogger("master")


class StepGuard:
    def __init__(self) -> None:
        self.notice = PreemptNotice()  # the controller role installs it as the signal handler
        self.updating = False  # a trainer update of the step under way has begun

    @property
    def urgent(self) -> bool:
        """SIGTERM came: start nothing new."""
        return self.notice.urgent

    @property
    def stop_after_step(self) -> str | None:
        """Why to checkpoint and stop once the step under way ends, or None."""
        return self.notice.reason

    def waiting(self, what: str) -> None:
        """Give the step up while waiting (`what`) after SIGTERM."""
        if self.urgent:
            raise Interrupted(f"SIGTERM while {what}")

    def begin_update(self, what: str) -> None:
        """The step's first trainer update (`what`) is about to start: refused after SIGTERM."""
        if not self.updating:
            if self.urgent:
                raise Interrupted(f"SIGTERM before {what}")
            self.updating = True

    def step_done(self) -> None:
        self.updating = False

    @contextlib.contextmanager
    def checkpoint_on_term(self, checkpoint_last: Callable[[Exception], None]) -> Iterator[None]:
        """Around the loop: a failure after SIGTERM (the servers are gone) ends in `checkpoint_last(cause)`,
        which checkpoints the last finished step and raises Preempted, unless an update was under way."""
        try:
            yield
        except Preempted:
            raise
        except Exception as exc:
            if not self.urgent or self.updating:
                raise
            checkpoint_last(exc)
