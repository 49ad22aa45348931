"""The OpenAI-compatible endpoint of a rollout process: an agent program reaches the policy through it, and is
trained as it is (docs/agents.md).

Routes (``Authorization: Bearer <the episode's key>`` on each; stdlib ``http.server``, as the built-in
generation server)::

    GET  /v1/models, /v1/models/<id>     the one model served (rollout.agent_model)
    POST /v1/chat/completions            messages, tools, tool_choice (auto, none, required, a named function),
                                         parallel_tool_calls, temperature, top_p, max_tokens,
                                         max_completion_tokens, stop, seed, stream (+ stream_options)
    POST /v1/completions                 prompt (a string or token ids) and the same sampling fields
    POST /v1/responses                   the Responses API as a chat turn (agent.responses_api): input items,
                                         instructions, function tools, previous_response_id of the episode

Each episode gets a key of its own for as long as it runs (``open``/``close``); the run's secret never leaves
the role. A call is served token in, token out through the episode's context (gen.episode): a chat whose
messages extend the conversation so far appends only the new messages' tokens to the sampled ids; one that does
not starts a new sample of the episode (a break). A completion whose prompt text extends the last prompt and
completion appends only the new text's tokens. The calls of one episode are served one at a time. The tool
calls of the replies and the tool results the agent sends back are counted for its episode (agent.ToolUse).

Agents are hostile until checked (docs/agents.md, "What an agent can send"): the key is checked before the body
is read; a body must say its length (or come chunked) within a bound set by the model's context; text that
cannot fit the context is refused before it is rendered; whatever is the request's fault is a 4xx in OpenAI's
shape, counted for its episode (``refused_requests``), never a failure of the role. A connection that sends
nothing, or sends a request slowly, is closed after ``read_secs``; past ``max_connections`` a new connection is
answered 503 at once.

The endpoint binds 127.0.0.1: the agents run beside the rollout process, and nothing else should reach it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from areal_hpc.agent import ToolUse, bounds, responses_api
from areal_hpc.agent import openai_api as api
from areal_hpc.gen.client import GenServerError
from areal_hpc.gen.episode import EpisodeCancelled, EpisodeContext, InvalidRequest

logger = logging.getLogger("rollout")
MAX_BODY_BYTES = 64 * 2**20  # whatever the context
# JSON may spell one byte of text in six ("\u001f"): a body's bound is this many times its text's, plus room
JSON_BYTES_PER_TEXT_BYTE, BODY_ROOM = 6, 2**20
RESPONSES_KEPT = 8  # an episode's latest responses that previous_response_id may name
MAX_CONNECTIONS = 4096  # a thread each; every episode in flight holds one or two
READ_SECS = 30.0  # a connection idle this long, or this long sending one request, is closed
WRITE_SECS = 60.0  # a client that does not take its answer
# A server's refusal of what it was asked (a 4xx other than its key's) is the request's fault, not the servers'.
REFUSED_BY_SERVER = (400, 413, 422)
_LENGTH = re.compile(r"[0-9]{1,15}")
HTTP_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2")  # the HTTP clients of function agents


@dataclass
class Session:
    """One episode's use of the endpoint: its context, the event loop its group runs in, the last completion."""

    ctx: EpisodeContext
    loop: asyncio.AbstractEventLoop
    lock: threading.Lock = field(default_factory=threading.Lock)
    completion: tuple[str, list[int]] | None = None  # the last completion's prompt + text and their ids
    responses: dict[str, list[dict]] = field(default_factory=dict)  # /v1/responses: id -> its conversation
    tools: ToolUse = field(init=False)

    def __post_init__(self):
        self.tools = ToolUse(self.ctx.counts)

    @property
    def context(self) -> int | None:
        return self.ctx.max_context

    def body_limit(self) -> int:
        """The largest body this episode may send: one whose text could fit the model's context."""
        if self.context is None:
            return MAX_BODY_BYTES
        text = bounds.BYTES_PER_TOKEN * self.context
        return min(MAX_BODY_BYTES, JSON_BYTES_PER_TEXT_BYTE * text + BODY_ROOM)


class Endpoint:
    """Serves the OpenAI API to the episodes of one rollout process, on a port of its own."""

    def __init__(
        self,
        model: str,
        host: str = "127.0.0.1",
        max_connections: int = MAX_CONNECTIONS,
        read_secs: float = READ_SECS,
    ):
        self.model = model
        self.created = int(time.time())
        quiet_http_logs()
        self._sessions: dict[str, Session] = {}
        self._httpd = _Server((host, 0), _Handler, max_connections, read_secs)
        self._httpd.endpoint = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="openai-endpoint",
            daemon=True,
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def open(self, ctx: EpisodeContext) -> str:
        """A new key for the episode of ``ctx`` (called in its group's event loop)."""
        key = f"sk-episode-{secrets.token_urlsafe(24)}"
        self._sessions[key] = Session(ctx, asyncio.get_running_loop())
        return key

    def close(self, key: str) -> None:
        """The episode ended: its key is refused from now on."""
        self._sessions.pop(key, None)

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def session(self, authorization: str | None) -> Session:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or (session := self._sessions.get(key.strip())) is None:
            raise api.ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <the key the "
                               "episode was given>'", code="invalid_api_key")  # fmt: skip
        return session

    def call(self, session: Session, serve: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``serve`` in the episode's event loop and wait for it (the episode's calls one at a time). What the
        request caused is the agent's (ApiError); what the servers or the role caused ends the episode (503)."""
        with session.lock:
            if session.ctx.failure:  # the SDK retries a 503: answer at once
                raise _failed(session.ctx.failure)
            try:
                return _result(serve, session.loop)
            except api.ApiError:
                raise
            except InvalidRequest as exc:
                raise api.bad(exc.param, exc.message) from exc
            except GenServerError as exc:
                if exc.status not in REFUSED_BY_SERVER:
                    raise _fail(session, exc) from exc
                raise api.ApiError(400, f"the generation server refused the request: {exc.message}",
                                   code="invalid_request") from exc  # fmt: skip
            except BaseException as exc:  # the servers or the role, not the agent: the episode ends with this
                raise _fail(session, exc) from exc

    # --- the routes, in the episode's event loop ---------------------------------------------------------

    async def chat(self, session: Session, request: api.Request) -> tuple[dict, dict]:
        ctx = session.ctx
        sampling = _bounded(ctx, request.sampling)
        if (
            request.json_schema is not None
        ):  # the server's constrained decoding (SGLang; the built-in has none)
            sampling["json_schema"] = request.json_schema
        answered = session.tools.answered(request.messages)
        reply = await ctx.chat(
            request.messages, request.tools, sampling, request.stop, request.parse_tools,
            request.parallel_tool_calls, request.force_call, request.call_name,
        )  # fmt: skip
        session.tools.served(answered, ctx.pending_calls, request.tools)
        turn = ctx.last_turn
        context = len(ctx.trajectories[-1].ids) - len(turn.ids)
        return reply, {"finish": turn.finish, "usage": api.usage(context, len(turn.ids))}

    async def complete(self, session: Session, request: api.Request) -> tuple[str, dict]:
        ctx, prompt = session.ctx, request.prompt
        if isinstance(prompt, list):
            ids = list(prompt)
        elif session.completion and prompt.startswith(session.completion[0]):
            text, before = session.completion
            ids = before + ctx.tokenizer.encode(prompt[len(text) :], add_special_tokens=False)
        else:
            ids = ctx.tokenizer.encode(prompt)
        turn = await ctx.generate(ids, _bounded(ctx, request.sampling), request.stop)
        whole = ctx.tokenizer.decode(turn.ids, skip_special_tokens=True)
        # Text and ids continue each other only when the stop strings cut nothing off.
        session.completion = (
            (prompt + turn.text, ids + turn.ids) if isinstance(prompt, str) and whole == turn.text else None
        )
        return turn.text, {"finish": turn.finish, "usage": api.usage(len(ids), len(turn.ids))}


def quiet_http_logs() -> None:
    """The HTTP client of the openai SDK (httpx; httpx2 from openai 3) logs each request of a function agent at
    INFO, a line per turn of every episode in the role's log: only at logging.level DEBUG; warnings always."""
    verbose = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def fits(session: Session, request: api.Request) -> None:
    """Refuse, before anything renders or tokenizes it, a request whose text cannot fit the model's context."""
    if (context := session.context) is None:
        return
    if isinstance(request.prompt, list):
        if len(request.prompt) >= context:
            raise api.ApiError(400, f"prompt: {len(request.prompt)} token ids leave no room in the model's "
                               f"context of {context}", "prompt", "context_length_exceeded")  # fmt: skip
        return
    what, text = ("prompt", request.prompt) if request.prompt is not None else ("messages", request.messages)
    size = bounds.text_bytes(text) + bounds.text_bytes(request.tools or [])
    if size > bounds.BYTES_PER_TOKEN * context:
        raise api.ApiError(
            400, f"{what}: {size} bytes of text cannot fit the model's context of {context} tokens (at most "
            f"{bounds.BYTES_PER_TOKEN} bytes a token are taken)", what, "context_length_exceeded",
        )  # fmt: skip


def _result(serve: Callable[[], Awaitable[Any]], loop: asyncio.AbstractEventLoop) -> Any:
    """What ``serve()`` gives in ``loop``; 409 when the loop closed before it ran (the episode ended)."""
    ended = api.ApiError(409, "the episode has ended", code="episode_ended")
    coroutine = serve()
    try:
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    except RuntimeError:  # the group's loop is closed
        coroutine.close()
        raise ended from None
    while True:
        try:
            return future.result(timeout=1.0)
        except concurrent.futures.TimeoutError:
            if loop.is_closed() and not future.done():
                raise ended from None


def _fail(session: Session, exc: BaseException) -> api.ApiError:
    failure = exc if isinstance(exc, Exception) else EpisodeCancelled("the episode was given up")
    session.ctx.failure = session.ctx.failure or failure
    return _failed(failure)


def _failed(failure: Exception) -> api.ApiError:
    return api.ApiError(503, f"the generation failed: {failure}", code="generation_failed")


def _bounded(ctx: EpisodeContext, sampling: dict) -> dict:
    """The request's sampling, its max_tokens at most the run's (ppo.gen.max_new_tokens)."""
    if "max_new_tokens" in sampling:
        return {**sampling, "max_new_tokens": min(sampling["max_new_tokens"], ctx.params["max_new_tokens"])}
    return sampling


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; a reaper closes those that have read one
    request (or waited for it) longer than ``read_secs``."""

    daemon_threads = True
    # Every episode of every group in flight may connect at once (hundreds): socketserver's backlog of 5
    # refused them (the SDK's APIConnectionError).
    request_queue_size = 4096
    endpoint: Endpoint

    def __init__(self, address, handler, max_connections: int, read_secs: float):
        self.max_connections, self.read_secs = max_connections, read_secs
        self.active = 0
        self.reading: dict[_Handler, float] = {}  # connection -> since when it waits for (part of) a request
        self.lock = threading.Lock()
        super().__init__(address, handler)
        threading.Thread(target=self._reap, name="openai-endpoint-reaper", daemon=True).start()

    def process_request(self, request: socket.socket, client_address) -> None:
        with self.lock:
            full = self.active >= self.max_connections
            self.active += not full
        if full:
            return self._refuse(request, f"the endpoint serves at most {self.max_connections} connections")
        try:
            super().process_request(request, client_address)  # a thread of its own
        except RuntimeError as exc:  # no thread to be had: this connection is refused, the endpoint lives
            with self.lock:
                self.active -= 1
            self._refuse(request, f"the endpoint cannot serve another connection now ({exc})")

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.active -= 1

    def _refuse(self, request: socket.socket, why: str) -> None:
        body = json.dumps(api.ApiError(503, f"{why}; try again", code="too_many_connections").body()).encode()
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        with contextlib.suppress(OSError):  # a client gone already needs no answer
            request.settimeout(0)  # the accepting thread never waits: a short answer fits the socket's buffer
            request.sendall(f"{head}\r\nConnection: close\r\n\r\n".encode() + body)
        self.shutdown_request(request)

    def _reap(self) -> None:
        while True:
            time.sleep(min(1.0, self.read_secs / 4))
            now = time.monotonic()
            with self.lock:
                late = [h for h, since in self.reading.items() if now - since > self.read_secs]
                for handler in late:
                    del self.reading[handler]
            for handler in late:  # its blocked read returns: the handler ends and its thread with it
                with contextlib.suppress(OSError):  # it closed meanwhile
                    handler.connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = WRITE_SECS  # the socket's: reads are bounded by the reaper, writes by this
    server: _Server
    session: Session | None = None

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        logger.debug("endpoint: " + format, *args)

    def handle_one_request(self) -> None:
        self._reading(True)
        try:
            super().handle_one_request()
        except OSError:  # the client hung up, or the reaper closed it: nobody to answer
            self.close_connection = True
        finally:
            self._reading(False)

    def _reading(self, waiting: bool) -> None:
        with self.server.lock:
            if waiting:
                self.server.reading[self] = time.monotonic()
            else:
                self.server.reading.pop(self, None)

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_POST(self) -> None:
        self._serve(self._post)

    def _serve(self, route: Callable[[], None]) -> None:
        self.session = None
        try:
            route()
        except ConnectionError:  # the client hung up: nobody to answer
            self.close_connection = True
        except api.ApiError as exc:
            if self.session is not None:  # the episode's agent asked for what it cannot have
                self.session.ctx.counts["refused_requests"] += exc.status < 500
            self._json(exc.status, exc.body())
        except Exception as exc:  # a bug of ours: the agent gets a 500, the log the traceback
            logger.exception("endpoint: %s %s failed", self.command, self.path)
            self._json(500, api.ApiError(500, f"internal error: {exc}").body())

    def _get(self) -> None:
        endpoint = self.server.endpoint
        self.session = self._authorized()
        if self._has_body():
            raise self._unread(400, "a GET request has no body")
        self._reading(False)
        path = self.path.rstrip("/")
        if path == "/v1/models":
            return self._json(200, api.models(endpoint.model, endpoint.created))
        if path == f"/v1/models/{endpoint.model}":
            return self._json(200, api.model_card(endpoint.model, endpoint.created))
        if path.startswith("/v1/models/"):
            raise api.ApiError(404, f"The model '{path.rsplit('/', 1)[-1]}' does not exist", "model",
                               "model_not_found")  # fmt: skip
        raise api.ApiError(404, f"no route {self.path}", code="unknown_url")

    def _post(self) -> None:
        endpoint = self.server.endpoint
        session = self.session = self._authorized()
        body = self._body(session.body_limit())
        self._reading(False)  # from here on the agent waits for us, not we for it
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), endpoint.model
        if self.path == "/v1/chat/completions":
            request = api.parse_chat(body, model)
            fits(session, request)
            reply, out = endpoint.call(session, lambda: endpoint.chat(session, request))
            if request.stream:
                use = out["usage"] if request.include_usage else None
                return self._stream(api.chat_chunks(reply, out["finish"], use, model, rid, created))
            return self._json(200, api.chat_response(reply, out["finish"], out["usage"], model, rid, created))
        if self.path == "/v1/responses":
            request, instructions = responses_api.parse_responses(body, model, session.responses)
            fits(session, request)
            reply, out = endpoint.call(session, lambda: endpoint.chat(session, request))
            rid = f"resp_{rid.removeprefix('chatcmpl-')}"
            session.responses[rid] = [*request.messages[instructions:], reply]
            for old in list(session.responses)[:-RESPONSES_KEPT]:
                del session.responses[old]
            return self._json(
                200, responses_api.response(reply, out["finish"], out["usage"], model, rid, created, body)
            )
        if self.path == "/v1/completions":
            request = api.parse_completion(body, model)
            fits(session, request)
            text, out = endpoint.call(session, lambda: endpoint.complete(session, request))
            rid = f"cmpl-{rid.removeprefix('chatcmpl-')}"
            if request.stream:
                use = out["usage"] if request.include_usage else None
                return self._stream(api.completion_chunks(text, out["finish"], use, model, rid, created))
            return self._json(
                200, api.completion_response(text, out["finish"], out["usage"], model, rid, created)
            )
        raise api.ApiError(404, f"no route {self.path}", code="unknown_url")

    def _authorized(self) -> Session:
        """The episode whose key the request carries; a request without one is refused before its body is
        read, and its connection closed (its body's bytes must not be taken for the next request)."""
        try:
            return self.server.endpoint.session(self.headers.get("Authorization"))
        except api.ApiError:
            self.close_connection = True
            raise

    # --- the body: its length said once, or chunked; within the episode's bound ----------------------------

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0") != "0"

    def _body(self, limit: int) -> Any:
        encodings = self.headers.get_all("Transfer-Encoding") or []
        lengths = self.headers.get_all("Content-Length") or []
        if encodings:
            if lengths or [e.strip().lower() for e in ",".join(encodings).split(",")] != ["chunked"]:
                raise self._unread(400, "Transfer-Encoding: only 'chunked', and without a Content-Length")
            raw = self._chunked(limit)
        elif not lengths:
            raise self._unread(411, "Content-Length: a request body must say its length")
        elif len(lengths) > 1 or not _LENGTH.fullmatch(lengths[0].strip()):
            raise self._unread(400, f"Content-Length: must be one non-negative integer, got {lengths}")
        elif (length := int(lengths[0])) > limit:
            raise self._unread(413, f"the request body of {length} bytes is larger than this episode's "
                               f"{limit} (what the model's context can hold)")  # fmt: skip
        else:
            raw = self._read(length)
        try:
            return bounds.loads(raw or b"null")
        except bounds.Unusable as exc:
            raise api.bad(exc.where, exc.what) if exc.where else api.ApiError(400, str(exc)) from exc
        except ValueError as exc:
            raise api.ApiError(400, f"the request body is not JSON: {exc}") from exc

    def _read(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) < n:  # the client hung up midway: nobody to answer
            raise ConnectionError("the request body ended early")
        return data

    def _chunked(self, limit: int) -> bytes:
        data = bytearray()
        while True:
            line = self.rfile.readline(1024)
            size = line.split(b";")[0].strip()
            if not line.endswith(b"\n") or not re.fullmatch(rb"[0-9a-fA-F]{1,8}", size):
                raise self._unread(400, "a chunk of the body does not start with its size")
            if not (n := int(size, 16)):
                break
            if len(data) + n > limit:
                raise self._unread(413, f"the chunked body is larger than this episode's {limit} bytes")
            data += self._read(n)
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise self._unread(400, "a chunk of the body is longer than its size")
        for _ in range(64):  # trailers, up to the empty line
            if self.rfile.readline(1024) in (b"\r\n", b"\n", b""):
                return bytes(data)
        raise self._unread(400, "the chunked body's trailer does not end")

    def _unread(self, status: int, message: str) -> api.ApiError:
        """The refusal of a request whose body is left unread: the connection closes after the answer."""
        self.close_connection = True
        return api.ApiError(status, message)

    # --- answers -------------------------------------------------------------------------------------------

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[dict]) -> None:
        """Server-sent events: the reply is whole before the first chunk (training needs the whole turn)."""
        data = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
