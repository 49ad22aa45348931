"""The scheduler: which rows run in which slots, the pages of the KV pool they hold, their prefill, and decode
steps one step ahead of the host.

A row is admitted while the pool can hold its context now (its cached prefix reused, the rest in new pages)
with a page to spare for each running row; it takes a page more each ``PAGE`` tokens it decodes. When the
pool runs out mid-decode, the rows admitted last are retracted: their pages go to the prefix cache, their
tokens are kept, and they wait first in line to be prefilled again (mostly from that cache), as SGLang's
retract does. Admitting by the current length, not by prompt + max_new_tokens, lets a long-tailed batch run as
many rows as its actual lengths fit; retraction is the price when they all grow.

New rows take the lowest free slots; the n samples of a prompt share one prefill and its full pages; finished
rows free their slot at once, and the highest running rows move down into freed slots, so a step runs the
smallest bucket that holds them (continuous batching). A decode step is launched before the previous step's
tokens are read, so the device never waits for the host: a row that ended at step t has its step t+1 computed
and dropped. A step is not launched when every row will have reached its token budget with the step in
flight. Only the engine thread touches a Scheduler.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_hpc.control import timeline
from areal_hpc.gen.backends.builtin.paged_decode import PAGE
from areal_hpc.gen.backends.builtin.pages import Pages
from areal_hpc.gen.backends.builtin.protocol import SamplingParams
from areal_hpc.gen.backends.builtin.runner import Fetched, Group, Runner, bucket

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
    pages: list[int] = field(default_factory=list)  # of the KV pool, in order: its block table
    epoch: int = 0  # of the weights its keys and values were computed with (the scheduler's at admission)
    admitted: int = 0  # admission order: the last admitted are retracted first
    cached_tokens: int = 0  # context tokens its prefills took from the prefix cache
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

    @property
    def writes(self) -> int:
        """The position the next decode step writes: that of the last token sampled (in flight included)."""
        return len(self.prompt) + len(self.output_ids) + self.inflight - 1

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
    """The running rows over a Runner's slots and the pages of its pool."""

    def __init__(self, runner: Runner, context_len: int):
        self.runner = runner
        self.limit = context_len  # longest sequence: prompt + answer
        self.pages = Pages(runner.plan.pages)
        self.epoch = 0
        self.rows: list[Row] = []  # always replaced, never mutated: other threads may read a snapshot
        self.stats: Counter[str] = runner.stats  # one set of counters: the runner's graph captures too
        self._free = list(range(runner.slots))
        self._pending: tuple[Fetched, list[tuple[Row, int]]] | None = None
        self._admissions = 0
        self._blocked = -1  # pages available when admission last failed: no retry until more are
        self._stretch: list | None = None  # [start, rows, steps] of the decode steps since the rows changed
        # Routed experts are recorded by the forward that computes a token: a cached prefix has none to give.
        self.reuse = runner.routed_shape is None

    @property
    def capacity(self) -> int:
        return self.runner.slots

    def admit(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        """Prefill as many of ``rows`` (in order) as the pool holds and sample their first token; returns the
        rows that finished (those of this step, and any of the step in flight) and those not admitted."""
        for row in rows:
            if row.params.max_new_tokens == 0:
                row.finish_reason = {"type": "length", "length": 0}
        finished = [r for r in rows if r.done]
        waiting = [r for r in rows if not r.done]
        if not waiting or (self.rows and self.pages.available <= self._blocked):
            return finished, waiting  # no page came free since the last try: keep the step in flight going
        finished += self.flush()
        by_context: dict[tuple[int, ...], list[Row]] = {}  # the n samples of a prompt share its prefill
        for row in waiting:
            by_context.setdefault(tuple(row.context), []).append(row)
        groups: list[Group] = []
        members: list[list[Row]] = []
        admitted: set[int] = set()
        for same in by_context.values():
            placed = self._place(same, reserve=len(self.rows) + len(admitted))
            if placed is None:
                self._blocked = self.pages.available
                break
            group, taken = placed
            new = sum(len(g.context) - g.start for g in groups)
            if groups and new + len(group.context) - group.start > PREFILL_TOKENS:
                self._prefill(groups, members)
                groups, members = [], []
            groups.append(group)
            members.append(taken)
            admitted.update(map(id, taken))
            if len(taken) < len(same):
                break  # the pool is full: the rest wait, in their order
        if groups:
            self._prefill(groups, members)
        waiting = [r for r in waiting if id(r) not in admitted]
        if not waiting:
            self._blocked = -1
        return finished + self._prune(), waiting

    def _place(self, rows: list[Row], reserve: int) -> tuple[Group, list[Row]] | None:
        """Give the first rows of ``rows`` (one context) that the pool holds a slot and pages: a cached prefix
        and the new full pages shared, a page of its own for a partial last page, and a page to spare for each
        of them and of the ``reserve`` rows running. Returns their prefill group and them, or None."""
        context = rows[0].context
        cached = self.pages.match(context, len(context) - 1) if self.reuse else []
        full = len(context) // PAGE - len(cached)
        tail = 1 if len(context) % PAGE else 0
        room = self.pages.available - full - reserve
        fits = max(room, 0) // (tail + 1) or int(reserve == 0 and room >= tail)  # alone, no page to spare
        n = min(len(rows), len(self._free), fits)
        if n == 0:
            self.pages.release(cached)
            return None
        fresh = self.pages.take(full + n * tail)
        shared = cached + fresh[:full]
        self.pages.hold(cached, n - 1)
        self.pages.hold(fresh[:full], n - 1)
        for i, row in enumerate(rows[:n]):
            row.slot = heapq.heappop(self._free)
            row.pages = shared + fresh[full + i * tail : full + (i + 1) * tail]
            row.epoch, row.admitted = self.epoch, self._admissions
            self._admissions += 1
            row.cached_tokens += len(cached) * PAGE
        self.stats["cached_tokens"] += n * len(cached) * PAGE
        taken = rows[:n]
        return Group(context, len(cached) * PAGE, [r.slot for r in taken], [r.pages for r in taken]), taken

    def _prefill(self, groups: list[Group], members: list[list[Row]]) -> None:
        start = time.monotonic()
        rows = [r for m in members for r in m]
        tokens = sum(len(g.context) - g.start for g in groups)
        with timeline.span("prefill", rows=len(rows), tokens=tokens):
            self.runner.sampling.set(
                [r.slot for r in rows],
                [r.params for r in rows],
                [r.seed for r in rows],
                [r.stop_ids for r in rows],
                [len(r.output_ids) for r in rows],  # a retracted row's stream goes on where it stopped
            )
            self.runner.set_pages([(r.slot, 0, r.pages) for r in rows])
            done = self.runner.prefill(groups)
            for j, group in enumerate(members):
                for row in group:
                    if row.routed is not None and done.routed is not None:
                        # The n samples of a prompt share its prefill; a retracted row's covers its output too.
                        row.routed = [done.routed[j]]
            for row, token, logprob in zip(rows, done.tokens, done.logprobs, strict=True):
                row.append(token, logprob, self.limit)
        self.rows = self.rows + rows
        self._count(rows, prefill=True, secs=time.monotonic() - start)
        self.stats["prefill_tokens"] += tokens
        self.stats["generated_tokens"] += len(rows)

    def step(self) -> tuple[list[Row], list[Row]]:
        """Launch a decode step (if a row wants a token) and read the previous one; returns the rows that
        finished and those retracted for want of pages (to admit again)."""
        start = time.monotonic()
        finished, retracted = self._grow()
        wanting = [r for r in self.rows if r.wants(self.limit)]
        self._trace_decode(time.time(), len(wanting))
        launched = None
        if wanting:
            fetched = self.runner.decode(bucket(max(r.slot for r in self.rows) + 1, self.capacity))
            for row in wanting:
                row.inflight += 1
            launched = (fetched, [(r, r.slot) for r in wanting])
        previous, self._pending = self._pending, launched
        finished += self._collect(previous)
        if launched:
            self._count(wanting, prefill=False, secs=time.monotonic() - start)
        return finished, retracted

    def _trace_decode(self, now: float, rows: int) -> None:
        """The timeline gets one ``decode`` span for each stretch of steps at the same rows (its rows and
        steps give the time a step took), not an event a step."""
        stretch = self._stretch
        if stretch is not None and stretch[1] == rows:
            stretch[2] += 1
            return
        if stretch is not None:
            timeline.event("decode", stretch[0], now - stretch[0], rows=stretch[1], steps=stretch[2])
        self._stretch = [now, rows, 1] if rows else None

    def _grow(self) -> tuple[list[Row], list[Row]]:
        """A page for each row whose next write starts one; when the pool has too few, the step in flight is
        read (its finished rows give theirs back), then the rows admitted last are retracted."""
        finished, retracted = [], []
        short = self._short()
        if len(short) > self.pages.available:
            finished = self.flush()
            short = self._short()
            while len(short) > self.pages.available:
                last = max(self.rows, key=lambda r: r.admitted)
                self._leave([last])
                last.slot = -1
                self.rows = [r for r in self.rows if r is not last]
                retracted.append(last)
                short = self._short()
            self.stats["retracted_rows"] += len(retracted)
        if short:
            pages = self.pages.take(len(short))
            self.runner.set_pages([(r.slot, len(r.pages), [p]) for r, p in zip(short, pages, strict=True)])
            for row, page in zip(short, pages, strict=True):
                row.pages.append(page)
        return finished, retracted

    def _short(self) -> list[Row]:
        return [r for r in self.rows if r.wants(self.limit) and r.writes >= len(r.pages) * PAGE]

    def flush(self) -> list[Row]:
        """Read the step in flight (before rows are admitted or aborted); returns the rows it finished."""
        pending, self._pending = self._pending, None
        self._trace_decode(time.time(), 0)
        return self._collect(pending)

    def flush_cache(self) -> int:
        """Forget the prefix cache (new weights, or the pool's memory given back): the keys and values of rows
        running now are not cached when they end. Returns the pages forgotten."""
        self.epoch += 1
        return self.pages.flush()

    def retract(self) -> tuple[list[Row], list[Row]]:
        """Free every running row's slot and pages (SGLang's pause mode retract; the pages stay in the prefix
        cache); returns the rows the step in flight finished, and the retracted rows, to admit again (their
        prefill recomputes what the cache no longer holds)."""
        finished = self.flush()
        retracted, self.rows = self.rows, []
        self._leave(retracted)
        for row in retracted:
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

    def _leave(self, rows: list[Row]) -> None:
        """Rows stop running: their slots are freed, their full pages of keys and values cached (unless the
        weights changed since they were computed) and their pages released."""
        if not rows:
            return
        self.runner.free([r.slot for r in rows])
        for row in rows:
            heapq.heappush(self._free, row.slot)
            if self.reuse and row.epoch == self.epoch:
                self.pages.insert(row.context[:-1], row.pages)  # the last token's keys are not computed
            self.pages.release(row.pages)
            row.pages = []

    def _prune(self) -> list[Row]:
        """Free the slots and pages of finished rows and move the highest running rows down into freed
        slots."""
        finished = [r for r in self.rows if r.done]
        if not finished:
            return []
        self._leave(finished)
        self.rows = [r for r in self.rows if not r.done]
        size = bucket(len(self.rows), self.capacity)
        for row in sorted(self.rows, key=lambda r: -r.slot):
            if row.slot < size or self._free[0] >= row.slot:
                break
            dst = heapq.heappop(self._free)
            self.runner.move(row.slot, dst)
            heapq.heappush(self._free, row.slot)
            row.slot = dst
        return finished

    def pool(self) -> dict:
        """The pool's state for /server_info: positions held by running rows, pages cached."""
        return {"free_pages": self.pages.free, "available_pages": self.pages.available,
                "cached_pages": self.pages.cached}  # fmt: skip

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
