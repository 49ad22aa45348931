"""The run's timeline: every role process appends its phases, as events, to a file of its own on shared storage.

    timeline.record(run.timeline_file("trainer0", attempt))       # once, when the role starts
    with timeline.span("train_step", step=3, mfc="actor_train"):  # anywhere in the role's code
        ...

An event is one line of JSON: its name, start (Unix seconds), duration (seconds) and arguments. ``overlap=True``
marks a span that runs beside others of the same process (a generation request among hundreds in flight); the
others nest. ``server=i`` names the generation server a span waits on (`areal-hpc trace` shows it on the
server's track too). A full garbage collection is a ``gc`` span. Lines are buffered and appended by a daemon
thread once a second and at exit, so an event costs a clock read, a dict and its JSON; a process that dies loses
at most its last second, and a torn last line is skipped by the reader (monitor/trace.py). In a process that
records nothing (tests, tools) a span costs a global lookup.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FLUSH_SECS = 1.0


class Recorder:
    """Buffers events and appends them to `path` (one writer per file) every `flush_secs` and on `close`. The
    buffer is a deque (its appends and pops are atomic): no lock, so an event may be added from anywhere, a
    garbage collection's callback inside another `add` included."""

    def __init__(self, path: str | os.PathLike, flush_secs: float = FLUSH_SECS):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lines: deque[str] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._flush_every, args=(flush_secs,), daemon=True)
        self._thread.start()

    def add(self, event: dict[str, Any]) -> None:
        self._lines.append(json.dumps(event, separators=(",", ":"), default=str))

    def flush(self) -> None:
        lines = [self._lines.popleft() for _ in range(len(self._lines))]
        if not lines:
            return
        try:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")
        except OSError:  # shared storage away for a moment: the lines wait for the next flush
            self._lines.extendleft(reversed(lines))
            raise

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self.flush()

    def _flush_every(self, secs: float) -> None:
        while not self._closed.wait(secs):
            with contextlib.suppress(OSError):
                self.flush()


_recorder: Recorder | None = None
# A forked child (a sandbox's worker) has no flushing thread: it records nothing unless it calls `record`.
os.register_at_fork(after_in_child=lambda: globals().update(_recorder=None))


def record(path: str | os.PathLike | None, **first: Any) -> None:
    """This process's events go to `path` from now on (None: nowhere); `first`: arguments of a `start` event
    that opens the file's record (attempt, host, ...)."""
    global _recorder
    stop()
    if path is not None:
        _recorder = Recorder(path)
        instant("start", **first)
        if _full_collections not in gc.callbacks:
            gc.callbacks.append(_full_collections)


def stop() -> None:
    """Write what is buffered and record nothing more."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.close()


atexit.register(stop)


@contextmanager
def span(name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Record the block as a span `name`; the yielded dict takes arguments known only inside it."""
    recorder = _recorder
    if recorder is None:
        yield args
        return
    start, clock = time.time(), time.perf_counter()
    try:
        yield args
    finally:
        recorder.add({"name": name, "ts": start, "dur": time.perf_counter() - clock, **args})


def event(name: str, start: float, dur: float, **args: Any) -> None:
    """A span timed by its caller (start: Unix seconds): one event for what happened many times over."""
    if _recorder is not None:
        _recorder.add({"name": name, "ts": start, "dur": dur, **args})


_gc_start = (0.0, 0.0)


def _full_collections(phase: str, info: dict[str, int]) -> None:
    """A ``gc`` span for each full collection: one over a big heap stops every thread of the process."""
    global _gc_start
    if info["generation"] != 2 or _recorder is None:
        return
    if phase == "start":
        _gc_start = (time.time(), time.perf_counter())
    else:
        dur = time.perf_counter() - _gc_start[1]
        # tracked: what the next full collection walks again (frozen objects are not among them)
        event("gc", _gc_start[0], dur, collected=info["collected"], tracked=len(gc.get_objects(generation=2)))


def instant(name: str, **args: Any) -> None:
    if _recorder is not None:
        _recorder.add({"name": name, "ts": time.time(), **args})
