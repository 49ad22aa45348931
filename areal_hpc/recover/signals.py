"""Notice of preemption, of the time limit or of a stop: write a recover checkpoint, then stop.

USR2 comes `signal_grace_secs` before the time limit or on preemption (the job script forwards it to every
step): the controller finishes the running step, checkpoints and stops. SIGTERM (scancel, `scontrol
requeue`, preemption, a local stop) leaves only Slurm's KillWait: the controller stops at once, checkpoints
the last finished step (or finishes the update already under way) and exits. Slurm sends SIGTERM to every
task together, so the trainers outlive it (`outlive_term`) until the controller has saved their state.
"""

from __future__ import annotations

import logging
import signal
import sys

logger = logging.getLogger("recover")
# The controller's exit code after it stopped on a notice with a recover checkpoint written (EX_TEMPFAIL):
# the job script requeues without counting a failure.
EXIT_PREEMPTED = 75
# How long a trainer serves on after SIGTERM for the controller's checkpoint; Slurm's KillWait (30 s by
# default) or the local launcher's stop grace usually ends it sooner.
TRAINER_TERM_GRACE_SECS = 30


class PreemptNotice:
    """Installed in the controller's main thread; `reason` is None until a notice came, `urgent` once a
    SIGTERM came (stop before starting another update)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.urgent = False

    def install(self, on_term: bool = True) -> PreemptNotice:
        signal.signal(signal.SIGUSR2, self._on_usr2)
        if on_term:
            signal.signal(signal.SIGTERM, self._on_term)
        return self

    def _on_usr2(self, signum: int, frame) -> None:
        if self.reason is None:
            self.reason = "USR2 (preemption or time limit)"
            logger.warning("USR2: writing a recover checkpoint at the end of this step, then stopping")

    def _on_term(self, signum: int, frame) -> None:
        if not self.urgent:  # Slurm and srun may both deliver it
            self.urgent = True
            self.reason = "SIGTERM (scancel, requeue, preemption or stop)"
            logger.warning(
                "SIGTERM: writing a recover checkpoint of the last finished step now, then stopping"
            )


class Preempted(RuntimeError):
    """The controller stopped after a notice, with its state in a recover checkpoint."""


class Interrupted(RuntimeError):
    """A step given up after SIGTERM, before its update began: the trainers are as the last step left them."""


def outlive_term(grace: float = TRAINER_TERM_GRACE_SECS) -> None:
    """A trainer's SIGTERM handler: serve on for `grace` seconds (the controller's checkpoint needs this
    process), then exit; the controller's stop request usually comes first."""

    def on_term(signum: int, frame) -> None:
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            logger.warning(
                "SIGTERM: serving on for the controller's recover checkpoint (at most %.0f s)", grace
            )
            signal.signal(signal.SIGALRM, lambda *_: sys.exit(143))
            signal.setitimer(signal.ITIMER_REAL, grace)

    signal.signal(signal.SIGTERM, on_term)
