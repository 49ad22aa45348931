"""Notice of preemption or of the time limit: finish the step, write a recover checkpoint, stop.

Slurm sends USR2 `signal_grace_secs` before the time limit and when a job is preempted (the job script
forwards it to every step); the controller acts on it at the end of the running step. SIGTERM (scancel, a
local stop) is no notice: Slurm sends it to every task at once, so the trainers whose state a checkpoint
needs are already gone; every role exits on it, and the next attempt resumes from the last periodic one.
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger("recover")
# The controller's exit code after it stopped on a notice with a recover checkpoint written (EX_TEMPFAIL):
# the job script requeues without counting a failure.
EXIT_PREEMPTED = 75


class PreemptNotice:
    """Installed in the controller's main thread; `reason` is None until a notice came."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> PreemptNotice:
        signal.signal(signal.SIGUSR2, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        if self.reason is None:
            self.reason = f"{signal.Signals(signum).name} (preemption or time limit)"
            logger.warning("USR2: writing a recover checkpoint at the end of this step, then stopping")


class Preempted(RuntimeError):
    """The controller stopped after a notice, with its state in a recover checkpoint."""
