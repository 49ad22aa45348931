"""Notice of preemption or of the time limit: finish the step, write a recover checkpoint, stop.

Slurm sends USR2 `signal_grace_secs` before the time limit and when a job is preempted (the job script
forwards it to every step); SIGTERM comes from `scancel`, a preemption without --signal, or a local stop.
The first one is noted and the controller acts on it at the end of the running step; a second SIGTERM
exits at once.
"""

from __future__ import annotations

import logging
import signal
import sys

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
        signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and signum == signal.SIGTERM:
            sys.exit(143)
        if self.reason is None:
            self.reason = f"{name} (preemption, time limit or stop)"
            logger.warning("%s: writing a recover checkpoint at the end of this step, then stopping", name)


class Preempted(RuntimeError):
    """The controller stopped after a notice, with its state in a recover checkpoint."""
