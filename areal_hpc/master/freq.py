"""Frequency control of save / checkpoint / evaluation: every N epochs OR N steps OR N seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class FrequencyControl:
    """Fires when any of its set frequencies is reached since it last fired; null frequencies never fire."""

    def __init__(
        self,
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.freq_epochs, self.freq_steps, self.freq_secs = freq_epochs, freq_steps, freq_secs
        self.clock = clock
        self.epochs = self.steps = 0
        self.last = clock()

    def check(self, epochs: int = 0, steps: int = 0) -> bool:
        """Count `epochs` finished epochs and `steps` finished steps; True (and reset) if a frequency is met."""
        self.epochs += epochs
        self.steps += steps
        now = self.clock()
        fire = (
            (self.freq_epochs is not None and self.epochs >= self.freq_epochs)
            or (self.freq_steps is not None and self.steps >= self.freq_steps)
            or (self.freq_secs is not None and now - self.last >= self.freq_secs)
        )
        if fire:
            self.epochs = self.steps = 0
            self.last = now
        return fire

    def state_dict(self) -> dict[str, Any]:
        """Counters since the last firing, and seconds elapsed (restored relative to the new clock)."""
        return {"epochs": self.epochs, "steps": self.steps, "elapsed": self.clock() - self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs, self.steps = state["epochs"], state["steps"]
        self.last = self.clock() - state["elapsed"]
