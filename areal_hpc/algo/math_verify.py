"""Math rewards computed in worker processes, each check under a time limit (REFERENCE.md section 6).

sympy can run for ever on a pathological answer (`9^{9^{9}}` computes a 370-million-digit integer), and a
running Python call cannot be interrupted from outside, so every check runs in a worker process that is
killed and replaced when its check overruns; such a check scores 0 and the pool stays usable.
concurrent.futures cannot kill a running task, hence this small pool: one pipe per worker, spawn context.

    with MathVerifier(n_workers=2, timeout=3.0) as verifier:
        rewards = verifier.verify_batch([(response, [solution]), ...])
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from areal_hpc.algo.math_parse import AnswerInputError, as_text, is_correct, warm_up

logger = logging.getLogger(__name__)

_READY = "ready"


class VerifierError(RuntimeError):
    """The pool itself failed: a worker process could not be started."""


def _serve(conn: Connection) -> None:
    """Worker process: answer (response, solution) requests with True/False until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    warm_up()
    conn.send(_READY)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        try:
            ok = is_correct(*request)
        except Exception:  # an answer that breaks the checker is simply not correct
            ok = False
        conn.send(ok)


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    deadline: float  # of its start while not ready, of its check while busy
    ready: bool = False
    check: int | None = None  # index of the running check


Check = tuple[int, str, str]  # (item index, response, solution)


class MathVerifier:
    """A pool of math-checking worker processes; reusable for the life of a process, thread-safe.

    Use it as a context manager or call `close()`. Construction waits until every worker is ready.
    """

    def __init__(self, n_workers: int = 2, timeout: float = 3.0, start_timeout: float = 120.0) -> None:
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive integer, got {n_workers!r}")
        if not timeout > 0 or not start_timeout > 0:
            raise ValueError(
                f"timeouts must be positive, got timeout={timeout!r}, start_timeout={start_timeout!r}"
            )
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False
        self._started = False
        self._workers = [self._spawn() for _ in range(n_workers)]
        try:
            self.wait_ready()
            self._started = True  # from now on a worker that dies, even while starting, is replaced
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Until every worker is ready (a replaced one takes seconds to start: Math-Verify's imports)."""
        with self._lock:
            while not all(worker.ready for worker in self._workers):
                self._wait_step([], [])

    def verify(self, response: str, solutions: Sequence[str]) -> float:
        """1.0 if `response` states the final answer of any of `solutions`, else 0.0."""
        return self.verify_batch([(response, solutions)])[0]

    def verify_batch(self, items: Iterable[tuple[str, Sequence[str]]]) -> list[float]:
        """Scores of (response, solutions) pairs, checked concurrently; a check that overruns scores 0."""
        pairs = [_checked_item(item) for item in items]
        checks = [
            (index, response, solution)
            for index, (response, solutions) in enumerate(pairs)
            for solution in solutions
        ]
        scores = [0.0] * len(pairs)
        with self._lock:
            if self._closed:
                raise VerifierError("MathVerifier is closed")
            self._run(checks, scores)
        return scores

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

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            with contextlib.suppress(Exception):  # at interpreter exit, modules may be half torn down
                self.close()

    # -- scheduling (callers hold self._lock) --

    def _run(self, checks: list[Check], scores: list[float]) -> None:
        pending = deque(range(len(checks)))
        while True:
            for worker in [worker for worker in self._workers if worker.ready and worker.check is None]:
                # An item already matched needs no more checks.
                while pending and scores[checks[pending[0]][0]] == 1.0:
                    pending.popleft()
                if not pending:
                    break
                if not self._send(worker, pending[0], checks[pending[0]]):
                    continue
                pending.popleft()
            if not pending and all(worker.check is None for worker in self._workers):
                return
            self._wait_step(checks, scores)

    def _send(self, worker: _Worker, index: int, check: Check) -> bool:
        """Start a check on an idle worker; False (and the worker replaced) if it had died."""
        try:
            worker.conn.send(check[1:])
        except OSError:
            self._replace(worker, f"math worker {worker.process.pid} died while idle")
            return False
        worker.check = index
        worker.deadline = time.monotonic() + self.timeout
        return True

    def _wait_step(self, checks: list[Check], scores: list[float]) -> None:
        """Wait for one reply or deadline; record replies, replace workers that overran or died."""
        waiting = [worker for worker in self._workers if not worker.ready or worker.check is not None]
        delay = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic())
        answered = wait([worker.conn for worker in waiting], timeout=delay)
        for worker in waiting:
            if worker.conn in answered:
                self._receive(worker, checks, scores)
            elif time.monotonic() >= worker.deadline:
                if not worker.ready:
                    raise VerifierError(f"math worker did not start within {self.start_timeout:.0f} s")
                answer = checks[worker.check][1]
                self._replace(worker, f"math check timed out after {self.timeout:g} s on {answer[-80:]!r}")

    def _receive(self, worker: _Worker, checks: list[Check], scores: list[float]) -> None:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            if not worker.ready and not self._started:  # the first start: a setup error, not bad luck
                raise VerifierError(
                    f"math worker {worker.process.pid} exited while starting (see its stderr; a script that"
                    " creates a MathVerifier needs the `if __name__ == '__main__':` guard)"
                ) from None
            what = "a check" if worker.ready else "its start"
            self._replace(worker, f"math worker {worker.process.pid} died during {what}")
            return
        if not worker.ready:
            worker.ready, worker.deadline = True, float("inf")  # its only message while starting
            return
        if reply:
            scores[checks[worker.check][0]] = 1.0
        worker.check, worker.deadline = None, float("inf")

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child,), daemon=True, name="math-verifier")
        process.start()
        child.close()
        return _Worker(process, parent, deadline=time.monotonic() + self.start_timeout)

    def _replace(self, worker: _Worker, reason: str) -> None:
        logger.warning("%s; starting a new worker (the check scores 0)", reason)
        _stop(worker, grace=0.0)
        self._workers[self._workers.index(worker)] = self._spawn()


def _stop(worker: _Worker, grace: float) -> None:
    worker.process.join(grace)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join()
    worker.conn.close()


def _checked_item(item: object) -> tuple[str, list[str]]:
    """Validate one (response, solutions) pair."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise AnswerInputError(f"each item must be a (response, solutions) pair, got {item!r:.200}")
    response, solutions = item
    if isinstance(solutions, str) or not isinstance(solutions, Sequence) or not solutions:
        raise AnswerInputError(f"solutions must be a non-empty list of strings, got {solutions!r:.200}")
    return as_text(response, "response"), [as_text(solution, "solution") for solution in solutions]
