"""The scheduler: which rows run in which slots, their prefill, and decode steps one step ahead of the host.

New rows take the lowest free slots; the n samples of a prompt share one prefill; finished rows free their slot
at once, and the highest running rows move down into freed slots, so a step runs the smallest bucket that
holds them (continuous batching). A decode step is launched before the previous step's tokens are read, so
the device never waits for the host: a row that ended at step t has its step t+1 computed and dropped. A step
is not launched when every row will have reached its token budget with the step in flight. Only the engine
thread touches a Scheduler.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_hpc.gen.backends.builtin.protocol import SamplingParams
from areal_hpc.gen.backends.builtin.runner import Fetched, Runner, bucket

PREFILL_TOKENS = 16384  # prompt tokens of one prefill pass: bounds its activations (reserved in cache.py)


@dataclass(eq=False)
class Row:
    """One sequence being generated: one sample of one prompt of a request (its ``owner``)."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # tokens that end the row: EOS unless ignore_eos, and stop_token_ids
    seed: int  # of the row's random stream
    owner: Any = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    slot: int = -1
    inflight: int = 0  # tokens of launched steps not read yet
    # With routed experts asked for: what each forward of the row chose, [tokens, layers, k] per chunk (the
    # prompt's, then one per decode step: the experts of its input token, the previous output).
    routed: list[np.ndarray] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def context(self) -> list[int]:
        """What the row's prefill reads: its prompt, and after a retraction its output so far."""
        return self.prompt + self.output_ids

    def wants(self, limit: int) -> bool:
        """Whether a token beyond those in flight may still be needed."""
        made = len(self.output_ids) + self.inflight
        budget = self.params.max_new_tokens
        return (budget is None or made < budget) and len(self.prompt) + made < limit

    def append(self, token: int, logprob: float, limit: int, routed: np.ndarray | None = None) -> None:
        """Record a generated token (and the routed experts of the step's input) and decide whether the row is
        finished."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.routed is not None and routed is not None:
            self.routed.append(routed.copy())  # a view of the runner's buffer, which later steps reuse
        budget = self.params.max_new_tokens
        if token in self.stop_ids:  # stop tokens are banned before min_new_tokens, so this respects it
            self.finish_reason = {"type": "stop", "matched": token}
        elif budget is not None and len(self.output_ids) >= budget:
            self.finish_reason = {"type": "length", "length": budget}
        elif len(self.prompt) + len(self.output_ids) >= limit:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}

    def abort(self, message: str) -> None:
        """Finish the row now with what it has, as SGLang reports an aborted request."""
        if not self.done:
            self.finish_reason = {"type": "abort", "message": message}


class Scheduler:
    """The running rows over a Runner's slots."""

    def __init__(self, runner: Runner, context_len: int):
        self.runner = runner
        self.limit = min(context_len, runner.slot_len)  # longest sequence: prompt + answer
        self.rows: list[Row] = []  # always replaced, never mutated: other threads may read a snapshot
        self.stats: Counter[str] = Counter()
        self._free = list(range(runner.slots))
        self._pending: tuple[Fetched, list[tuple[Row, int]]] | None = None

    @property
    def capacity(self) -> int:
        return self.runner.slots

    def admit(self, rows: list[Row]) -> list[Row]:
        """Prefill ``rows`` into free slots (at most ``capacity`` rows run) and sample their first token;
        returns the rows that finished (those of this step, and any of the step in flight)."""
        for row in rows:
            if row.params.max_new_tokens == 0:
                row.finish_reason = {"type": "length", "length": 0}
        finished = [r for r in rows if r.done] + self.flush()
        groups: dict[tuple[int, ...], list[Row]] = {}
        for row in rows:
            if not row.done:
                groups.setdefault(tuple(row.context), []).append(row)
        chunk: list[list[Row]] = []
        for group in groups.values():
            if chunk and sum(len(g[0].context) for g in chunk) + len(group[0].context) > PREFILL_TOKENS:
                self._prefill(chunk)
                chunk = []
            chunk.append(group)
        if chunk:
            self._prefill(chunk)
        return finished + self._prune()

    def _prefill(self, groups: list[list[Row]]) -> None:
        start = time.monotonic()
        rows = [r for g in groups for r in g]
        for row in rows:
            row.slot = heapq.heappop(self._free)
        self.runner.sampling.set(
            [r.slot for r in rows],
            [r.params for r in rows],
            [r.seed for r in rows],
            [r.stop_ids for r in rows],
            [len(r.output_ids) for r in rows],  # a retracted row's stream goes on where it stopped
        )
        done = self.runner.prefill([g[0].context for g in groups], [[r.slot for r in g] for g in groups])
        for j, group in enumerate(groups):
            for row in group:
                if row.routed is not None and done.routed is not None:
                    # The n samples of a prompt share its prefill; a retracted row's covers its output too.
                    row.routed = [done.routed[j]]
        for row, token, logprob in zip(rows, done.tokens, done.logprobs, strict=True):
            row.append(token, logprob, self.limit)
        self.rows = self.rows + rows
        self._count(rows, prefill=True, secs=time.monotonic() - start)
        self.stats["generated_tokens"] += len(rows)

    def step(self) -> list[Row]:
        """Launch a decode step (if a row wants a token) and read the previous one; returns finished rows."""
        start = time.monotonic()
        wanting = [r for r in self.rows if r.wants(self.limit)]
        launched = None
        if wanting:
            fetched = self.runner.decode(bucket(max(r.slot for r in self.rows) + 1, self.capacity))
            for row in wanting:
                row.inflight += 1
            launched = (fetched, [(r, r.slot) for r in wanting])
        previous, self._pending = self._pending, launched
        finished = self._collect(previous)
        if launched:
            self._count(wanting, prefill=False, secs=time.monotonic() - start)
        return finished

    def flush(self) -> list[Row]:
        """Read the step in flight (before rows are admitted or aborted); returns the rows it finished."""
        pending, self._pending = self._pending, None
        return self._collect(pending)

    def retract(self) -> tuple[list[Row], list[Row]]:
        """Free every running row's slot, its KV cache dropped (SGLang's pause mode retract); returns the rows
        the step in flight finished, and the retracted rows, to admit again (their prefill recomputes it)."""
        finished = self.flush()
        retracted, self.rows = self.rows, []
        if retracted:
            self.runner.free([r.slot for r in retracted])
        for row in retracted:
            heapq.heappush(self._free, row.slot)
            row.slot = -1
        return finished, retracted

    def abort(self, match: Callable[[Row], bool], message: str) -> list[Row]:
        """Finish every row for which ``match(row)`` holds, with finish reason abort; returns finished rows."""
        finished = self.flush()
        for row in self.rows:
            if match(row):
                row.abort(message)
        return finished + self._prune()

    def _collect(self, pending: tuple[Fetched, list[tuple[Row, int]]] | None) -> list[Row]:
        if pending is None:
            return []
        fetched, rows = pending
        tokens, logprobs = fetched.lists()
        routed = fetched.routed_rows()
        for row, slot in rows:
            row.inflight -= 1
            if not row.done:
                experts = None if routed is None else routed[slot : slot + 1]
                row.append(tokens[slot], logprobs[slot], self.limit, experts)
                self.stats["generated_tokens"] += 1
        return self._prune()

    def _prune(self) -> list[Row]:
        """Free the slots of finished rows and move the highest running rows down into freed slots."""
        finished = [r for r in self.rows if r.done]
        if not finished:
            return []
        self.runner.free([r.slot for r in finished])
        for row in finished:
            heapq.heappush(self._free, row.slot)
        self.rows = [r for r in self.rows if not r.done]
        size = bucket(len(self.rows), self.capacity)
        for row in sorted(self.rows, key=lambda r: -r.slot):
            if row.slot < size or self._free[0] >= row.slot:
                break
            dst = heapq.heappop(self._free)
            # Its keys: the prompt, the tokens read, those in flight and the one about to be written.
            self.runner.move(
                row.slot, dst, min(len(row.prompt) + len(row.output_ids) + row.inflight + 1, self.limit)
            )
            heapq.heappush(self._free, row.slot)
            row.slot = dst
        return finished

    def _count(self, rows: list[Row], prefill: bool, secs: float) -> None:
        """Counters shown by /server_info: they show whether concurrent requests shared forward passes, and
        where the engine's time went."""
        self.stats["forward_passes"] += 1
        self.stats["prefill_passes" if prefill else "decode_steps"] += 1
        self.stats["prefill_secs" if prefill else "decode_secs"] += secs
        if not prefill:
            self.stats["decode_rows"] += len(rows)
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(rows))
        requests = len({id(r.owner) for r in rows})
        self.stats["max_requests_per_forward"] = max(self.stats["max_requests_per_forward"], requests)
