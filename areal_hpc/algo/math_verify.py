"""Math rewards computed in worker processes, each check under a time limit (REFERENCE.md section 6).

sympy can run for ever on a pathological answer (`9^{9^{9}}` computes a 370-million-digit integer), so every
check runs in a `TimedPool` worker, killed and replaced when its check overruns; such a check scores 0.

    with MathVerifier(n_workers=2, timeout=3.0) as verifier:
        rewards = verifier.verify_batch([(response, [solution]), ...])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from areal_hpc.algo.math_parse import AnswerInputError, as_text
from areal_hpc.algo.timed_pool import Outcome, PoolError, TimedPool

VerifierError = PoolError  # the pool itself failed: a worker could not be started, or the verifier is closed


class MathVerifier:
    """A pool of math-checking worker processes; reusable for the life of a process, thread-safe.

    Use it as a context manager or call `close()`. Construction waits until every worker is ready.
    """

    def __init__(self, n_workers: int = 2, timeout: float = 3.0, start_timeout: float = 120.0) -> None:
        self.pool = TimedPool(
            "areal_hpc.algo.math_parse:is_correct",
            n_workers,
            timeout,
            setup="areal_hpc.algo.math_parse:warm_up",
            start_timeout=start_timeout,
            name="math verifier",
        )
        self.timeout = self.pool.timeout

    def wait_ready(self) -> None:
        """Until every worker is ready (a replaced one takes seconds to start: Math-Verify's imports)."""
        self.pool.wait_ready()

    def verify(self, response: str, solutions: Sequence[str]) -> float:
        """1.0 if `response` states the final answer of any of `solutions`, else 0.0."""
        return self.verify_batch([(response, solutions)])[0]

    def verify_batch(self, items: Iterable[tuple[str, Sequence[str]]]) -> list[float]:
        """Scores of (response, solutions) pairs, checked concurrently; a check that overruns or fails scores 0."""
        pairs = [_checked_item(item) for item in items]
        checks = [
            (index, response, solution)
            for index, (response, solutions) in enumerate(pairs)
            for solution in solutions
        ]
        scores = [0.0] * len(pairs)

        def record(i: int, outcome: Outcome) -> None:
            if outcome.status == "ok" and outcome.value:
                scores[checks[i][0]] = 1.0

        # An item already matched needs no more checks.
        self.pool.run([c[1:] for c in checks], skip=lambda i: scores[checks[i][0]] == 1.0, on_done=record)
        return scores

    def close(self) -> None:
        """Stop the workers (a hung one is killed). Idempotent."""
        self.pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _checked_item(item: object) -> tuple[str, list[str]]:
    """Validate one (response, solutions) pair."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise AnswerInputError(f"each item must be a (response, solutions) pair, got {item!r:.200}")
    response, solutions = item
    if isinstance(solutions, str) or not isinstance(solutions, Sequence) or not solutions:
        raise AnswerInputError(f"solutions must be a non-empty list of strings, got {solutions!r:.200}")
    return as_text(response, "response"), [as_text(solution, "solution") for solution in solutions]
