"""Per-worker request and reply mailboxes under ``<folder>/<worker>/`` (``RunDir.mailboxes``).

Layout: ``requests/<id>.json`` waits for the worker, ``replies/<id>.json`` waits for the caller. A request id
is ``<20-digit ns time>-<random hex>``, strictly increasing within a posting process, so sorting the names
gives posting order. Files are written tmp + rename; the worker deletes a request when it takes it (the
delete that succeeds is the one consumer, so each request is taken exactly once) and the caller deletes the
reply it read. On NFS, new files show up only as fast as the mount's attribute caching allows (``actimeo``,
``lookupcache``); Lustre and local disk see them at once.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_hpc.control import fsio
from areal_hpc.control.poll import ControlTimeout, poll_until


class ReplyTimeout(ControlTimeout):
    """No reply came in time; the message names the worker, the request type and id."""


class RemoteError(RuntimeError):
    """A worker's handler raised; carries the worker's error type, message and traceback text."""

    def __init__(self, worker: str, request_type: str, request_id: str, error: dict) -> None:
        self.worker = worker
        self.request_type = request_type
        self.request_id = request_id
        self.error_type = str(error.get("type", "Exception"))
        self.message = str(error.get("message", ""))
        self.traceback = str(error.get("traceback", ""))
        super().__init__(
            f"worker {worker!r} failed request {request_type!r} ({request_id}): "
            f"{self.error_type}: {self.message}\n--- remote traceback ---\n{self.traceback}"
        )


@dataclass(frozen=True)
class Request:
    """One request as the worker sees it. Hooks are dicts ``{"name": str}`` or ``{"name", "payload"}``."""

    id: str
    type: str
    payload: Any = None
    worker: str = ""
    pre_hooks: tuple[dict, ...] = ()
    post_hooks: tuple[dict, ...] = ()
    group_size: int = 1
    posted_at: float = field(default=0.0, compare=False)


def _hook(entry: str | dict | tuple | list) -> dict:
    """Normalise a hook given as ``name``, ``(name, payload)`` or ``{"name": ..., "payload": ...}``."""
    if isinstance(entry, str):
        return {"name": entry}
    if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str):
        return {"name": entry[0], "payload": entry[1]}
    if isinstance(entry, dict) and isinstance(entry.get("name"), str) and set(entry) <= {"name", "payload"}:
        return dict(entry)
    raise ValueError(f"hook {entry!r} must be a name, a (name, payload) pair or a dict with 'name'")


def _folder(root: Path, worker: str, kind: str) -> Path:
    return root / fsio.check_segment(worker, "worker name") / kind


_stamp_lock = threading.Lock()
_last_stamp = 0


def _new_request_id() -> str:
    """A unique id whose sort order is posting order within this process (even if the clock steps back)."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(_last_stamp + 1, time.time_ns())
        return f"{_last_stamp:020d}-{uuid.uuid4().hex[:12]}"


class Mailbox:
    """The caller side: post requests to workers and wait for their replies."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.root = Path(folder)
        self._types: dict[str, str] = {}  # request id -> type, for messages

    def post(
        self,
        worker: str,
        type: str,
        payload: Any = None,
        *,
        pre_hooks: Iterable[str | dict | tuple] = (),
        post_hooks: Iterable[str | dict | tuple] = (),
        group_size: int = 1,
    ) -> str:
        """Put a request in ``worker``'s mailbox and return its id. ``payload`` must be JSON."""
        request_id = _new_request_id()
        message = {
            "id": request_id,
            "type": type,
            "payload": payload,
            "pre_hooks": [_hook(h) for h in pre_hooks],
            "post_hooks": [_hook(h) for h in post_hooks],
            "group_size": int(group_size),
            "posted_at": time.time(),
        }
        fsio.write_json(_folder(self.root, worker, "requests") / f"{request_id}.json", message)
        self._types[request_id] = type
        return request_id

    def wait_reply(self, worker: str, request_id: str, timeout: float) -> Any:
        """The result of request ``request_id`` (the reply is consumed).

        Raises RemoteError if the worker's handler failed, ReplyTimeout if no reply came within ``timeout`` s.
        """
        path = _folder(self.root, worker, "replies") / f"{fsio.check_segment(request_id, 'request id')}.json"
        request_type = self._types.get(request_id, "?")
        try:
            reply = poll_until(
                lambda: fsio.read_json(path),
                timeout,
                f"worker {worker!r} to reply to request {request_type!r} ({request_id})",
                error=ReplyTimeout,
            )
        except ReplyTimeout as exc:
            raise ReplyTimeout(f"{exc}; {self._where(worker, request_id)}") from None
        fsio.remove(path)
        self._types.pop(request_id, None)
        if not reply.get("ok"):
            raise RemoteError(worker, reply.get("type", request_type), request_id, reply.get("error", {}))
        return reply.get("result")

    def _where(self, worker: str, request_id: str) -> str:
        queued = (_folder(self.root, worker, "requests") / f"{request_id}.json").exists()
        return "the request is still in its inbox (not taken)" if queued else "the worker took the request"

    def request(self, worker: str, type: str, payload: Any = None, *, timeout: float, **options: Any) -> Any:
        """``post`` then ``wait_reply``: one synchronous call; ``options`` are ``post``'s keywords."""
        return self.wait_reply(worker, self.post(worker, type, payload, **options), timeout)


class Inbox:
    """The worker side: take new requests, send replies."""

    def __init__(self, folder: str | os.PathLike, worker: str) -> None:
        self.worker = worker
        self.requests = _folder(Path(folder), worker, "requests")
        self.replies = _folder(Path(folder), worker, "replies")
        self.requests.mkdir(parents=True, exist_ok=True)
        self.replies.mkdir(parents=True, exist_ok=True)

    def poll(self) -> list[Request]:
        """Take the requests that arrived since the last poll, in posting order; each is returned once."""
        taken = []
        for name in fsio.list_names(self.requests):
            path = self.requests / name
            message = fsio.read_json(path)
            # The delete decides who consumes the request: a racing poller that lost gets False.
            if message is None or not fsio.remove(path):
                continue
            taken.append(
                Request(
                    id=message["id"],
                    type=message["type"],
                    payload=message.get("payload"),
                    worker=self.worker,
                    pre_hooks=tuple(message.get("pre_hooks", ())),
                    post_hooks=tuple(message.get("post_hooks", ())),
                    group_size=int(message.get("group_size", 1)),
                    posted_at=float(message.get("posted_at", 0.0)),
                )
            )
        return taken

    def reply(self, request: Request, result: Any) -> None:
        """Send ``result`` (JSON) as the reply; a result that is not JSON becomes an error reply."""
        try:
            self._send(request, {"ok": True, "result": result})
        except TypeError as exc:
            self.reply_error(request, exc)

    def reply_error(self, request: Request, exc: BaseException) -> None:
        """Send ``exc`` as the reply: its type name, message and traceback text."""
        text = "".join(traceback.format_exception(exc))
        error = {"type": type(exc).__name__, "message": str(exc), "traceback": text}
        self._send(request, {"ok": False, "error": error})

    def _send(self, request: Request, body: dict) -> None:
        body = {"id": request.id, "type": request.type, "worker": self.worker, "time": time.time(), **body}
        fsio.write_json(self.replies / f"{request.id}.json", body)
