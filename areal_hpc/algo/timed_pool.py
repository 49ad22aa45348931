"""Calls of one function in worker processes, each under a time limit: a worker whose call overruns (or dies) is
killed and replaced, and the pool stays usable. Rewards need it: sympy can run for ever on a pathological answer,
a user's reward function can hang, and a running Python call cannot be interrupted from outside.
concurrent.futures cannot kill a running task, hence this small pool: one pipe per worker, spawn context.

    with TimedPool("pkg.mod:check", n_workers=2, timeout=3.0, setup="pkg.mod:warm_up") as pool:
        outcomes = pool.run([(answer, solution), ...])   # Outcome("ok", value) | ("error", traceback) | ("timeout")
        outcomes = pool.run([(answer,), ...], kwargs=[{"task": "math"}, ...])   # keyword arguments too

`target` and `setup` are "module:function" names, imported in each worker (spawned processes share no objects
with their parent); `setup(*setup_args)` runs once as a worker starts, before its start-up deadline ends.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)
_READY = "ready"


class PoolError(RuntimeError):
    """The pool itself failed: a worker process could not be started."""


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | error | timeout | skipped
    value: Any = None  # the call's result (ok), its traceback as text (error)


SKIPPED = Outcome("skipped")


def resolve(name: str) -> Callable:
    """The function "module:attribute" names (the attribute may be dotted: "mod:Class.method")."""
    module, _, attr = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _serve(conn: Connection, target: str, setup: str | None, setup_args: tuple) -> None:
    """Worker process: answer (args, kwargs) requests with ("ok", result) or ("error", traceback) until told to stop.
    A coroutine result is run to its end here (an async function is as welcome as a plain one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if setup:
        resolve(setup)(*setup_args)
    fn = resolve(target)
    loop = None
    conn.send(_READY)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        try:
            args, kwargs = request
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                if loop is None:
                    import asyncio

                    loop = asyncio.new_event_loop()
                result = loop.run_until_complete(result)
            reply = ("ok", result)
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:  # a result that does not pickle
            conn.send(("error", traceback.format_exc()))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    deadline: float  # of its start while not ready, of its call while busy
    ready: bool = False
    call: int | None = None  # index of the running call


class TimedPool:
    """Worker processes calling `target`; reusable for the life of a process, thread-safe (one `run` at a time).

    Use it as a context manager or call `close()`. Construction waits until every worker is ready.
    """

    def __init__(
        self,
        target: str,
        n_workers: int = 2,
        timeout: float = 3.0,
        *,
        setup: str | None = None,
        setup_args: tuple = (),
        start_timeout: float = 120.0,
        name: str = "worker",
    ) -> None:
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive integer, got {n_workers!r}")
        if not timeout > 0 or not start_timeout > 0:
            raise ValueError(
                f"timeouts must be positive, got timeout={timeout!r}, start_timeout={start_timeout!r}"
            )
        self.target, self.setup, self.setup_args, self.name = target, setup, tuple(setup_args), name
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self._context = get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self._workers: list[_Worker] = []
        self._workers = [self._spawn() for _ in range(n_workers)]
        try:
            self.wait_ready()
            self._started = True  # from now on a worker that dies, even while starting, is replaced
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Until every worker is ready (a replaced one takes as long to start as the first)."""
        with self._lock:
            while not all(worker.ready for worker in self._workers):
                self._wait_step([], None)

    def run(
        self,
        calls: Sequence[tuple],
        kwargs: Sequence[dict] | None = None,
        skip: Callable[[int], bool] | None = None,
        on_done: Callable[[int, Outcome], None] | None = None,
    ) -> list[Outcome]:
        """The outcome of each call (an argument tuple, with `kwargs[i]` if given), run concurrently. `skip(i)`,
        asked as call i is about to start, lets the caller drop calls that earlier outcomes (reported to
        `on_done` as they come) made moot."""
        outcomes = [SKIPPED] * len(calls)
        requests = [(tuple(args), {} if kwargs is None else kwargs[i]) for i, args in enumerate(calls)]

        def done(i: int, outcome: Outcome) -> None:
            outcomes[i] = outcome
            if on_done is not None:
                on_done(i, outcome)

        with self._lock:
            if self._closed:
                raise PoolError(f"{self.name} pool is closed")
            pending = deque(range(len(calls)))
            while True:
                for worker in [w for w in self._workers if w.ready and w.call is None]:
                    while pending and skip is not None and skip(pending[0]):
                        pending.popleft()
                    if not pending:
                        break
                    if self._send(worker, pending[0], requests[pending[0]]):
                        pending.popleft()
                if not pending and all(worker.call is None for worker in self._workers):
                    return outcomes
                self._wait_step(calls, done)

    def close(self) -> None:
        """Stop the workers (a hung one is killed). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                with contextlib.suppress(OSError):  # already dead: _stop reaps it
                    worker.conn.send(None)
            for worker in self._workers:
                _stop(worker, grace=1.0)

    def __enter__(self) -> TimedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            with contextlib.suppress(Exception):  # at interpreter exit, modules may be half torn down
                self.close()

    # -- scheduling (callers hold self._lock) --

    def _send(self, worker: _Worker, index: int, request: tuple[tuple, dict]) -> bool:
        """Start a call on an idle worker; False (and the worker replaced) if it had died."""
        try:
            worker.conn.send(request)
        except OSError:
            self._replace(worker, f"{self.name} {worker.process.pid} died while idle")
            return False
        worker.call, worker.deadline = index, time.monotonic() + self.timeout
        return True

    def _wait_step(self, calls: Sequence[tuple], done) -> None:
        """Wait for one reply or deadline; record replies, replace workers that overran or died."""
        waiting = [worker for worker in self._workers if not worker.ready or worker.call is not None]
        delay = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic())
        answered = wait([worker.conn for worker in waiting], timeout=delay)
        for worker in waiting:
            if worker.conn in answered:
                self._receive(worker, done)
            elif time.monotonic() >= worker.deadline:
                if not worker.ready:
                    raise PoolError(f"{self.name} did not start within {self.start_timeout:.0f} s")
                index = worker.call
                self._replace(
                    worker, f"{self.name} call timed out after {self.timeout:g} s on {_show(calls[index])}"
                )
                done(index, Outcome("timeout"))

    def _receive(self, worker: _Worker, done) -> None:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            if not worker.ready and not self._started:  # the first start: a setup error, not bad luck
                raise PoolError(
                    f"{self.name} {worker.process.pid} exited while starting (see its stderr; a script that"
                    " creates a pool needs the `if __name__ == '__main__':` guard)"
                ) from None
            index = worker.call
            self._replace(
                worker,
                f"{self.name} {worker.process.pid} died during {'a call' if worker.ready else 'its start'}",
            )
            if index is not None:
                done(index, Outcome("error", "the worker process died during the call"))
            return
        if not worker.ready:
            worker.ready, worker.deadline = True, float("inf")  # its only message while starting
            return
        index = worker.call
        worker.call, worker.deadline = None, float("inf")
        done(index, Outcome(*reply))

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe()
        args = (child, self.target, self.setup, self.setup_args)
        process = self._context.Process(target=_serve, args=args, daemon=True, name=self.name)
        process.start()
        child.close()
        return _Worker(process, parent, deadline=time.monotonic() + self.start_timeout)

    def _replace(self, worker: _Worker, reason: str) -> None:
        logger.warning("%s; starting a new worker", reason)
        _stop(worker, grace=0.0)
        self._workers[self._workers.index(worker)] = self._spawn()


def _stop(worker: _Worker, grace: float) -> None:
    worker.process.join(grace)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join()
    worker.conn.close()


def _show(call: tuple) -> str:
    return repr(call)[-120:]
