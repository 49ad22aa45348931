"""WorkerServer: the request loop of a worker, with the original's blocking/flush semantics.

    handlers = {"spec": lambda p: {"n": 100}, "train_step": model.train_step}
    WorkerServer(run, "trainer0", handlers, hooks={"save": save}).serve()

Handlers map a request type to ``fn(payload) -> JSON result``; hooks map a hook name to ``fn(payload)``
(the hook's own payload if the request gave one, else the request's). Either may be a dict or an object
whose public methods are looked up by name. ``empty`` needs no handler. A handler or hook that raises
becomes an error reply to its request (the rest of that request is skipped); the worker keeps serving.
The loop ends on a ``stop`` request or when ``stop()`` is called; requests still queued are answered with
an error, and the heartbeat is marked stopped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from areal_hpc.control import timeline
from areal_hpc.control.flush import BLOCKING, FLUSH, STOP, flush_plan
from areal_hpc.control.heartbeat import Heartbeat
from areal_hpc.control.mailbox import Inbox, Request
from areal_hpc.control.poll import Backoff
from areal_hpc.control.rundir import RunDir

logger = logging.getLogger(__name__)


class WorkerStopped(RuntimeError):
    """The reply to a request that was queued when the worker stopped."""


def _labels(payload: Any) -> dict[str, Any]:
    """What names a request on the timeline: the model function call it runs, its step (1-based, as logged)."""
    if not isinstance(payload, dict):
        return {}
    labels = {k: payload[k] for k in ("mfc", "model") if isinstance(payload.get(k), str)}
    if isinstance(payload.get("global_step"), int):
        labels["step"] = payload["global_step"] + 1
    return labels


def _lookup(table: Mapping[str, Callable] | object, name: str) -> Callable | None:
    if isinstance(table, Mapping):
        return table.get(name)
    fn = None if name.startswith("_") else getattr(table, name, None)
    return fn if callable(fn) else None


class WorkerServer:
    """Serve the mailbox of worker ``name`` of run ``run`` until stopped."""

    def __init__(
        self,
        run: RunDir,
        name: str,
        handlers: Mapping[str, Callable] | object,
        hooks: Mapping[str, Callable] | object | None = None,
        *,
        blocking: Iterable[str] = (),
        heartbeat_interval: float = 1.0,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.handlers = handlers
        self.hooks = handlers if hooks is None else hooks
        self.blocking = BLOCKING | frozenset(blocking)
        self.inbox = Inbox(run.mailboxes, name)
        self.heartbeat = Heartbeat(run.heartbeats, name, heartbeat_interval)
        self.stop_event = stop_event or threading.Event()
        self.queue: list[Request] = []  # blocking requests waiting for a flush

    def stop(self) -> None:
        """Ask the loop to end (from another thread); it finishes the request at hand first."""
        self.stop_event.set()

    def serve(self) -> None:
        """Run the loop: poll, handle, reply; until a ``stop`` request or ``stop()``."""
        backoff = Backoff()
        with self.heartbeat:
            while not self.stop_event.is_set():
                requests = self.inbox.poll()
                if not requests:
                    backoff.sleep()
                    continue
                backoff.reset()
                for request in requests:
                    self.handle(request)
            self._fail_queued("the worker stopped before a flush")

    def handle(self, request: Request) -> None:
        """Handle one request: answer it now, or queue it until the next flush."""
        if self.stop_event.is_set():
            self.inbox.reply_error(request, WorkerStopped(f"worker {self.name!r} has stopped"))
        elif request.type == STOP:
            self.stop_event.set()
            self._fail_queued("a stop request came before a flush")
            self.inbox.reply(request, {"stopped": True})
        elif request.type == FLUSH:
            self.inbox.reply(request, self.flush())
        elif request.type in self.blocking:
            self.queue.append(request)
        else:
            try:
                result = self._compute(request)
            except Exception as exc:
                self._reply_error(request, exc)
            else:
                self.inbox.reply(request, result)

    def flush(self) -> dict:
        """Run the queued requests (see ``flush_plan``), reply to each; returns their ids, done and failed."""
        queued, self.queue = self.queue, []
        results: dict[str, Any] = {}
        failed: set[str] = set()
        for step in flush_plan(queued):
            request = step.request
            if request.id in failed:
                continue
            try:
                if step.hook is None:
                    results[request.id] = self._compute(request)
                else:
                    self._run_hook(request, step.hook, step.phase)
            except Exception as exc:
                failed.add(request.id)
                self._reply_error(request, exc)
        for request in queued:
            if request.id not in failed:
                self.inbox.reply(request, results[request.id])
        return {"done": [r.id for r in queued if r.id not in failed], "failed": sorted(failed)}

    def _compute(self, request: Request) -> Any:
        fn = _lookup(self.handlers, request.type)
        if fn is None:
            if request.type == "empty":
                return None
            raise LookupError(f"worker {self.name!r} has no handler for request type {request.type!r}")
        with timeline.span(request.type, **_labels(request.payload)):
            return fn(request.payload)

    def _run_hook(self, request: Request, hook: dict, phase: str) -> None:
        fn = _lookup(self.hooks, hook["name"])
        if fn is None:
            raise LookupError(
                f"worker {self.name!r} has no {phase}-hook {hook['name']!r} (request {request.type!r})"
            )
        fn(hook.get("payload", request.payload))

    def _reply_error(self, request: Request, exc: Exception) -> None:
        logger.warning("worker %s: request %s (%s) failed: %r", self.name, request.type, request.id, exc)
        self.inbox.reply_error(request, exc)

    def _fail_queued(self, why: str) -> None:
        queued, self.queue = self.queue, []
        for request in queued:
            self.inbox.reply_error(request, WorkerStopped(f"worker {self.name!r}: {why}"))


def serve(
    run: RunDir,
    name: str,
    handlers: Mapping[str, Callable] | object,
    hooks: Mapping[str, Callable] | object | None = None,
    **options: Any,
) -> None:
    """Build a WorkerServer and serve until stopped; ``options`` are WorkerServer's keywords."""
    WorkerServer(run, name, handlers, hooks, **options).serve()
