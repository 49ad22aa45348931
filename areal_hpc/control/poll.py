"""Adaptive polling: sleep briefly while things happen, longer while idle, and never wait forever."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MIN_SLEEP = 0.0002  # seconds: the first sleeps after activity, so a reply is seen within a fraction of a ms
MAX_SLEEP = 0.003  # seconds: the idle sleep, a few ms, so idle pollers cost little CPU and storage
GROWTH = 1.5  # gentler than doubling: a sleep overshoots the awaited event by at most half of itself


class ControlTimeout(TimeoutError):
    """A wait of the control layer ran out of time; the message names what it waited for."""


class Backoff:
    """Sleep durations growing from ``min_sleep`` to ``max_sleep``; ``reset()`` after activity."""

    def __init__(self, min_sleep: float = MIN_SLEEP, max_sleep: float = MAX_SLEEP) -> None:
        self.min_sleep = min_sleep
        self.max_sleep = max(min_sleep, max_sleep)
        self._next = min_sleep

    def reset(self) -> None:
        """Start again from the shortest sleep."""
        self._next = self.min_sleep

    def sleep(self, limit: float | None = None) -> None:
        """Sleep the current duration (at most ``limit`` seconds) and lengthen the next one."""
        duration = self._next if limit is None else max(0.0, min(self._next, limit))
        self._next = min(self._next * GROWTH, self.max_sleep)
        time.sleep(duration)


def poll_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    max_sleep: float = MAX_SLEEP,
    error: type[ControlTimeout] = ControlTimeout,
) -> T:
    """Call ``check()`` until it returns something other than None and return that.

    Raises ``error`` (a ``ControlTimeout``) saying "timed out after <timeout> s waiting for <what>".
    """
    deadline = time.monotonic() + timeout
    backoff = Backoff(max_sleep=max_sleep)
    while True:
        result = check()
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise error(f"timed out after {timeout:g} s waiting for {what}")
        backoff.sleep(left)
