"""The trainer ranks as the master sees them: a mailbox each, called together, watched by heartbeat."""

from __future__ import annotations

import time
from typing import Any

from areal_hpc.control import Mailbox, ReplyTimeout, RunDir, dead_workers


class WorkerDied(RuntimeError):
    """A worker stopped beating while the master waited for it."""


def trainer_name(rank: int) -> str:
    return f"trainer{rank}"


class TrainerGroup:
    """Posts one request per rank (then a flush, which runs blocking requests) and waits for every reply."""

    def __init__(self, run: RunDir, n_ranks: int, timeout: float = 3600.0, heartbeat_timeout: float = 30.0):
        self.run, self.n_ranks = run, n_ranks
        self.names = [trainer_name(r) for r in range(n_ranks)]
        self.mailbox = Mailbox(run.mailboxes)
        self.timeout, self.heartbeat_timeout = timeout, heartbeat_timeout

    def call(self, type: str, payloads: list[dict]) -> list[Any]:
        """Request `type` on every rank with its payload; the results in rank order."""
        if len(payloads) != self.n_ranks:
            raise ValueError(f"{type}: {len(payloads)} payloads for {self.n_ranks} ranks")
        ids = [self.mailbox.post(name, type, p) for name, p in zip(self.names, payloads, strict=True)]
        flushes = [self.mailbox.post(name, "flush") for name in self.names]
        results = [self.wait(name, rid) for name, rid in zip(self.names, ids, strict=True)]
        for name, rid in zip(self.names, flushes, strict=True):
            self.wait(name, rid)
        return results

    def call_all(self, type: str, payload: dict) -> list[Any]:
        """The same request on every rank (collectives such as save need every rank)."""
        return self.call(type, [payload] * self.n_ranks)

    def call_each(self, type: str, payload: Any = None, timeout: float | None = None) -> list[Any]:
        """Request `type` on every rank at once (no flush: for non-blocking types); the results in rank order."""
        ids = [self.mailbox.post(name, type, payload) for name in self.names]
        return [self.wait(name, rid, timeout) for name, rid in zip(self.names, ids, strict=True)]

    def call_one(self, rank: int, type: str, payload: Any = None, timeout: float | None = None) -> Any:
        """Request `type` on rank `rank` alone and wait for its result (no flush: for non-blocking types)."""
        name = self.names[rank]
        return self.wait(name, self.mailbox.post(name, type, payload), timeout)

    def wait(self, name: str, request_id: str, timeout: float | None = None) -> Any:
        """A reply within `timeout` (default: the group's), checking every second that the ranks are alive."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                return self.mailbox.wait_reply(name, request_id, timeout=1.0)
            except ReplyTimeout:
                dead = dead_workers(self.run.heartbeats, self.names, self.heartbeat_timeout)
                if dead:
                    raise WorkerDied(
                        f"{', '.join(dead)} stopped sending heartbeats for {self.heartbeat_timeout:.0f} s "
                        f"while the master waited for {name}"
                    ) from None
                if time.monotonic() > deadline:
                    raise

    def wait_started(self, timeout: float) -> None:
        """Until every rank answers a non-blocking `model_config` request."""
        for name in self.names:
            self.mailbox.request(name, "model_config", None, timeout=timeout)

    def stop(self) -> None:
        for name in self.names:
            self.mailbox.post(name, "stop")
