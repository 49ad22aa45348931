"""The OpenAI-compatible endpoint of a rollout process: an agent program reaches the policy through it, and is
trained as it is (docs/agents.md).

Routes (``Authorization: Bearer <the episode's key>`` on each; stdlib ``http.server``, as the built-in
generation server)::

    GET  /v1/models, /v1/models/<id>     the one model served (rollout.agent_model)
    POST /v1/chat/completions            messages, tools, tool_choice auto|none, temperature, top_p, max_tokens,
                                         max_completion_tokens, stop, seed, stream (+ stream_options)
    POST /v1/completions                 prompt (a string or token ids) and the same sampling fields

Each episode gets a key of its own for as long as it runs (``open``/``close``); the run's secret never leaves
the role. A call is served token in, token out through the episode's context (gen.episode): a chat whose
messages extend the conversation so far appends only the new messages' tokens to the sampled ids; one that does
not starts a new sample of the episode (a break). A completion whose prompt text extends the last prompt and
completion appends only the new text's tokens. The calls of one episode are served one at a time.

The endpoint binds 127.0.0.1: the agents run beside the rollout process, and nothing else should reach it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jinja2

from areal_hpc.agent import ChatTemplateError
from areal_hpc.agent import openai_api as api
from areal_hpc.gen.episode import EpisodeCancelled, EpisodeContext

logger = logging.getLogger("rollout")
MAX_BODY_BYTES = 64 * 2**20


@dataclass
class Session:
    """One episode's use of the endpoint: its context, the event loop its group runs in, the last completion."""

    ctx: EpisodeContext
    loop: asyncio.AbstractEventLoop
    lock: threading.Lock = field(default_factory=threading.Lock)
    completion: tuple[str, list[int]] | None = None  # the last completion's prompt + text and their ids


class Endpoint:
    """Serves the OpenAI API to the episodes of one rollout process, on a port of its own."""

    def __init__(self, model: str, host: str = "127.0.0.1"):
        self.model = model
        self.created = int(time.time())
        self._sessions: dict[str, Session] = {}
        self._httpd = _Server((host, 0), _Handler)
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
        key = (authorization or "").removeprefix("Bearer ").strip()
        if (session := self._sessions.get(key)) is None:
            raise api.ApiError(401, "Incorrect API key provided: use the key the episode was given",
                               code="invalid_api_key")  # fmt: skip
        return session

    def call(self, session: Session, serve: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``serve`` in the episode's event loop and wait for it (the episode's calls one at a time)."""
        with session.lock:
            if session.ctx.failure:  # the SDK retries a 503: answer at once
                raise _failed(session.ctx.failure)
            try:
                future = asyncio.run_coroutine_threadsafe(serve(), session.loop)
            except RuntimeError as exc:  # the group's loop is closed: the episode ended
                raise api.ApiError(409, "the episode has ended", code="episode_ended") from exc
            try:
                return future.result()
            except (ChatTemplateError, jinja2.TemplateError) as exc:
                raise api.ApiError(400, f"messages: the chat template cannot render them: {exc}", "messages",
                                   "invalid_value") from exc  # fmt: skip
            except api.ApiError:
                raise
            except BaseException as exc:  # the servers or the role, not the agent: the episode ends with this
                failure = exc if isinstance(exc, Exception) else EpisodeCancelled("the episode was given up")
                session.ctx.failure = session.ctx.failure or failure
                raise _failed(failure) from exc

    # --- the routes, in the episode's event loop ---------------------------------------------------------

    async def chat(self, session: Session, request: api.Request) -> tuple[dict, dict]:
        ctx = session.ctx
        sampling = _bounded(ctx, request.sampling)
        reply = await ctx.chat(
            request.messages, request.tools, sampling, request.stop, parse_tools=request.parse_tools
        )
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


def _failed(failure: Exception) -> api.ApiError:
    return api.ApiError(503, f"the generation failed: {failure}", code="generation_failed")


def _bounded(ctx: EpisodeContext, sampling: dict) -> dict:
    """The request's sampling, its max_tokens at most the run's (ppo.gen.max_new_tokens)."""
    if "max_new_tokens" in sampling:
        return {**sampling, "max_new_tokens": min(sampling["max_new_tokens"], ctx.params["max_new_tokens"])}
    return sampling


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Every episode of every group in flight may connect at once (hundreds): socketserver's backlog of 5
    # refused them (the SDK's APIConnectionError).
    request_queue_size = 4096
    endpoint: Endpoint


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        logger.debug("endpoint: " + format, *args)

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_POST(self) -> None:
        self._serve(self._post)

    def _serve(self, route: Callable[[], None]) -> None:
        try:
            route()
        except api.ApiError as exc:
            self._json(exc.status, exc.body())
        except Exception as exc:  # a bug of ours: the agent gets a 500, the log the traceback
            logger.exception("endpoint: %s %s failed", self.command, self.path)
            self._json(500, api.ApiError(500, f"internal error: {exc}").body())

    def _get(self) -> None:
        endpoint = self.server.endpoint
        endpoint.session(self.headers.get("Authorization"))
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
        body = self._body()  # read before any refusal: the connection stays usable
        session = endpoint.session(self.headers.get("Authorization"))
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), endpoint.model
        if self.path == "/v1/chat/completions":
            request = api.parse_chat(body, model)
            reply, out = endpoint.call(session, lambda: endpoint.chat(session, request))
            if request.stream:
                use = out["usage"] if request.include_usage else None
                return self._stream(api.chat_chunks(reply, out["finish"], use, model, rid, created))
            return self._json(200, api.chat_response(reply, out["finish"], out["usage"], model, rid, created))
        if self.path == "/v1/completions":
            request = api.parse_completion(body, model)
            text, out = endpoint.call(session, lambda: endpoint.complete(session, request))
            rid = f"cmpl-{rid.removeprefix('chatcmpl-')}"
            if request.stream:
                use = out["usage"] if request.include_usage else None
                return self._stream(api.completion_chunks(text, out["finish"], use, model, rid, created))
            return self._json(
                200, api.completion_response(text, out["finish"], out["usage"], model, rid, created)
            )
        raise api.ApiError(404, f"no route {self.path}", code="unknown_url")

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise api.ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw or b"null")
        except ValueError as exc:
            raise api.ApiError(400, f"the request body is not JSON: {exc}") from exc

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
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
