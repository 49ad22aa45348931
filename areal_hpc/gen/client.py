"""Client of a generation server speaking SGLang's HTTP API (real SGLang or the built-in server), stdlib only.

Every call has a timeout; every failure raises ``GenServerError`` naming the route, the HTTP status (None when
the server could not be reached) and the server's message. Each calling thread keeps its connection to the
server open between calls (HTTP/1.1 keep-alive): a publication sends a request per bucket, and on this
project's 2-core CPU a small call took 1.3 ms through urllib, 0.9 ms on a new connection, 0.4-0.5 ms on a kept
one (tools/bench_gen.py).

A client given its server's ``capacity`` (max_running_requests: the samples it decodes together) sends no
more than that many samples at once from this process: the surplus waits here, not in the server's queue,
where it would spend the time budget of its call (issue 28: a step of 512 x 16 long answers on 4 servers of 64
rows queues far longer than any budget). Every client of that server in the process shares one `Admission`.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from urllib.parse import urlsplit

import orjson

from areal_hpc.control import timeline
from areal_hpc.gen.adapters import ServedAdapter, version_of
from areal_hpc.weights import adapter_name

log = logging.getLogger(__name__)


class GenServerError(RuntimeError):
    """A failed call to a generation server."""

    def __init__(self, server: str, route: str, status: int | None, message: str):
        why = f"HTTP {status}" if status is not None else "unreachable"
        super().__init__(f"{route} on {server} failed ({why}): {message}")
        self.server, self.route, self.status, self.message = server, route, status, message


# How a connection the server closed fails the next request on it.
STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
SECS_PER_TOKEN = 0.1  # the slowest decoding a /generate call waits for (10 tokens/s per answer)
STOP_POLL_SECS = 0.5  # how often a request waiting for admission looks at its caller's stop event
# The one key of a request's params that is not a sampling parameter (SGLang refuses unknown keys there): the
# routing replay's shape (gen.routing). It asks for each token's routed experts: SGLang's top-level field
# return_routed_experts.
ROUTED_EXPERTS = "routed_experts"


class GenerationStopped(RuntimeError):
    """A request given up before it was sent: its caller stopped while it waited for admission."""


class Admission:
    """The samples this process may have at one server at once (its capacity); the rest wait, first come
    first served. A request of more samples than the capacity waits for all of it. No deadline: every
    holder is bounded by its own call's timeout, so every wait is bounded too."""

    def __init__(self, url: str, capacity: int):
        if capacity < 1:
            raise ValueError(f"the capacity of {url} must be at least 1, got {capacity}")
        self.url, self.capacity = url, capacity
        self.in_use = 0  # samples sent and not answered
        self.waiting = 0  # samples waiting for slots (`areal-hpc status` material)
        self._line: deque[object] = deque()  # waiting requests in arrival order
        self._cond = threading.Condition()

    @contextmanager
    def slots(self, n: int, stop: threading.Event | None = None) -> Iterator[None]:
        """Hold min(n, capacity) slots while the body runs. ``stop`` set while waiting: GenerationStopped."""
        n = min(n, self.capacity)
        self._enter(n, stop)
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= n
                self._cond.notify_all()

    def _enter(self, n: int, stop: threading.Event | None) -> None:
        me = object()
        with self._cond:
            self._line.append(me)
            self.waiting += n
            try:
                if not self._admits(me, n):
                    log.debug("%d samples wait for %s: %d of %d slots in use, %d samples waiting",
                              n, self.url, self.in_use, self.capacity, self.waiting)  # fmt: skip
                while not self._admits(me, n):
                    if stop is not None and stop.is_set():
                        raise GenerationStopped(f"/generate to {self.url} not sent: stopped while waiting "
                                                f"for {n} of its {self.capacity} slots")  # fmt: skip
                    self._cond.wait(STOP_POLL_SECS if stop is not None else None)
                self.in_use += n
            finally:
                self._line.remove(me)
                self.waiting -= n
                self._cond.notify_all()  # the next in line may go now

    def _admits(self, me: object, n: int) -> bool:
        return self._line[0] is me and self.in_use + n <= self.capacity


_admissions: weakref.WeakValueDictionary[str, Admission] = weakref.WeakValueDictionary()
_admissions_lock = threading.Lock()


def admission(url: str, capacity: int) -> Admission:
    """This process's admission to the server at ``url``, shared by all its clients of that server."""
    with _admissions_lock:
        found = _admissions.get(url)
        if found is None:
            found = _admissions[url] = Admission(url, capacity)
        elif found.capacity != capacity:
            raise ValueError(
                f"{url} has a capacity of {found.capacity} samples in this process, not {capacity}"
            )
        return found


class GenClient:
    """Calls one generation server at ``url`` with the run's bearer ``token``. With a ``tokenizer``, an
    answer without ``text`` (SGLang with --skip-tokenizer-init, as AReaL launches it) gets it decoded here.
    With a ``capacity``, /generate calls wait for admission (see the module's docstring); None: no limit.
    ``name`` (a run's ``gen_server<i>``) goes into errors beside the URL."""

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float = 600.0,
        tokenizer=None,
        capacity: int | None = None,
        name: str | None = None,
        adapters: bool = False,
    ):
        self.url, self.token, self.timeout, self.tokenizer = url.rstrip("/"), token, timeout, tokenizer
        # weight_update_mode adapter: each request names the adapter of the server's version (gen.adapters)
        self.served = ServedAdapter(self._weight_version) if adapters else None
        self.name = name or self.url
        self.where = f"{name} ({self.url})" if name else self.url  # how errors name the server
        self.admission = admission(self.url, capacity) if capacity is not None else None
        self._local = threading.local()  # this thread's kept-alive connection
        self._context: tuple[int | None] | None = None  # (context_length,) once asked

    # --- generation ---------------------------------------------------------------------------------------

    def generate(
        self,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        rid: str | list[str] | None = None,
        *,
        text: str | list[str] | None = None,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[dict]:
        """Generate for one prompt or a list of prompts (or ``text``); always a list, prompt-major, n each.
        The timeout starts once admitted and grows with max_new_tokens: a long answer at a slow but working
        server is no failure. ``stop`` set while waiting for admission: GenerationStopped, nothing sent.
        ``sampling_params[ROUTED_EXPERTS]`` asks for the routed experts (see ROUTED_EXPERTS)."""
        params = sampling_params or {}
        body: dict[str, Any] = {"sampling_params": params, "return_logprob": return_logprob}
        if params.get(ROUTED_EXPERTS):  # routing replay: gen.routing decodes the answers' routing
            body["sampling_params"] = {k: v for k, v in params.items() if k != ROUTED_EXPERTS}
            body["return_routed_experts"] = True
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        budget = self.timeout + SECS_PER_TOKEN * (params.get("max_new_tokens") or 0)
        n = n_prompts(input_ids if input_ids is not None else text) * params.get("n", 1)
        with self.admission.slots(n, stop) if self.admission else nullcontext():
            result, version = self._send(body, timeout or budget)
        responses = result if isinstance(result, list) else [result]
        for r in responses:
            if "text" not in r and self.tokenizer is not None:
                r["text"] = self.tokenizer.decode(r["output_ids"], skip_special_tokens=True)
            if version is not None:  # the version of the adapter it ran on (gen.adapters)
                r["meta_info"]["weight_version"] = str(version)
                if r["meta_info"].get("finish_reason", {}).get("type") == "abort":
                    self.served.expire()
        return responses

    def _send(self, body: dict, timeout: float) -> tuple[Any, int | None]:
        """POST /generate; with adapters, naming the one of the server's version: a request the server
        refuses for its adapter (its version moved on since we asked: the adapter named is gone, or the base
        is no longer served) goes once more under the name of the server's version now. Returns the answer
        and the version named (None: no adapters)."""
        if self.served is None:
            return self._call("POST", "/generate", body, timeout), None
        for last in (False, True):
            version = self.served.version()
            name = adapter_name(version)
            try:
                return self._call(
                    "POST", "/generate", body | ({"lora_path": name} if name else {}), timeout
                ), version
            except GenServerError as exc:
                if last or exc.status != 400 or "LoRA adapter" not in exc.message:
                    raise
                self.served.expire()
        raise AssertionError("unreachable")

    def _weight_version(self) -> int:
        """The server's weight version (``/model_info``): the adapter its requests name."""
        label = self.model_info().get("weight_version")
        try:
            return version_of(label)
        except ValueError as exc:
            raise GenServerError(self.where, "/model_info", 200, str(exc)) from None

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict:
        """Abort request ``rid``, or every request; they answer with what they have and finish reason abort."""
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        return self._call("POST", "/abort_request", body)

    def pause_generation(self, mode: str = "abort") -> dict:
        """Stop generating until ``continue_generation``; mode abort returns in-flight requests as aborted."""
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        """Resume after ``pause_generation``."""
        return self._call("POST", "/continue_generation", {})

    # --- weights and cache --------------------------------------------------------------------------------

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | int | None = None,
        abort_all_requests: bool = True,
        timeout: float | None = None,
    ) -> dict:
        """Make the server load the HF weights in ``model_path``; raises GenServerError unless it succeeded.
        ``abort_all_requests`` is always sent: this method aborts running requests unless told not to (the
        server's own default, SGLang's, lets them finish first)."""
        body: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._succeed("/update_weights_from_disk", body, timeout)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        group_timeout: float | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Make the server join the weight group whose store rank 0 serves at ``master_address:master_port``.

        The server's rank is ``rank_offset`` (plus its TP rank on SGLang); the call returns once every rank of
        the group joined. ``group_timeout`` bounds the group's waits on the built-in server (``timeout_secs``,
        ignored by SGLang); ``timeout`` bounds the HTTP call.
        """
        body: dict[str, Any] = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        if group_timeout is not None:
            body["timeout_secs"] = group_timeout  # ours: SGLang ignores it
        return self._succeed("/init_weights_update_group", body, timeout)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = True,
        load_format: str | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Make the server receive these tensors from rank 0 of the group and load them (SGLang's names).

        With ``load_format="flattened_bucket"`` they come as one flat buffer, else one broadcast each. The call
        returns once they are received and swapped in. ``abort_all_requests`` is always sent (see
        ``update_weights_from_disk``).
        """
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return self._succeed("/update_weights_from_distributed", body, timeout)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        weight_version: str | int | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> dict:
        """Make the server copy the tensors a process of its host shares (``weights.shared``: one entry per TP
        rank of the server); returns once they are swapped in."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "flush_cache": True,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._succeed("/update_weights_from_tensor", body, timeout)

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None) -> dict:
        """Make the server load the PEFT adapter in folder ``lora_path`` under ``lora_name`` (SGLang's route;
        running requests go on meanwhile)."""
        body = {"lora_name": lora_name, "lora_path": str(lora_path)}
        return self._succeed("/load_lora_adapter", body, timeout, why="error_message")

    def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> dict:
        """Make the server forget adapter ``lora_name`` (SGLang waits for the requests that run on it)."""
        return self._succeed("/unload_lora_adapter", {"lora_name": lora_name}, timeout, why="error_message")

    def update_weight_version(
        self, version: int, abort_all_requests: bool, timeout: float | None = None
    ) -> dict:
        """Make the server report ``version`` as its weights' (and abort its running requests: they come back
        with finish reason abort and what they have)."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return self._succeed("/update_weight_version", body, timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Make the server leave the weight group."""
        return self._succeed("/destroy_weights_update_group", {"group_name": group_name})

    def release_memory_occupation(self, tags: list[str] | None = None, timeout: float | None = None) -> None:
        """Make the idle server give back its GPU memory (tags weights, kv_cache, cuda_graph; None: all), so
        that trainers on the same GPUs can use it; it cannot generate until resumed."""
        self._call("POST", "/release_memory_occupation", {"tags": tags}, timeout)

    def resume_memory_occupation(self, tags: list[str] | None = None, timeout: float | None = None) -> None:
        """Make the server take back the memory of ``tags`` (None: all); resumed weights need an update."""
        self._call("POST", "/resume_memory_occupation", {"tags": tags}, timeout)

    def _succeed(self, route: str, body: dict, timeout: float | None = None, why: str = "message") -> dict:
        """POST ``body``; raises GenServerError unless the answer says ``success`` (and with the answer's
        ``why``: SGLang's LoRA routes say it in error_message, the others in message)."""
        result = self._call("POST", route, body, timeout)
        if not isinstance(result, dict) or not result.get("success", False):
            message = result.get(why, str(result)) if isinstance(result, dict) else str(result)
            raise GenServerError(self.where, route, 200, message)
        return result

    def flush_cache(self) -> None:
        """Drop the server's prefix cache."""
        self._call("POST", "/flush_cache", {})

    # --- state --------------------------------------------------------------------------------------------

    def health(self, timeout: float = 5.0) -> bool:
        """True when the server answers /health with 200."""
        try:
            self._call("GET", "/health", None, timeout)
        except GenServerError:
            return False
        return True

    def wait_healthy(self, timeout: float, interval: float = 0.2) -> None:
        """Poll /health until it answers 200; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health(timeout=max(min(interval * 5, deadline - time.monotonic()), 0.1)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"generation server {self.url} not healthy after {timeout} s")
            time.sleep(interval)

    def model_info(self) -> dict:
        """``{"model_path", "tokenizer_path", "is_generation", "weight_version"}``."""
        return self._call("GET", "/model_info")

    def server_info(self) -> dict:
        """Server arguments and state (weight_version, running and queued request counts, stats)."""
        return self._call("GET", "/server_info")

    def context_length(self) -> int | None:
        """The most tokens (prompt and answer) the server takes: /server_info's ``context_length``, the built-in
        server's own and SGLang's --context-length (null there when not given: then None). Asked once."""
        if self._context is None:
            value = self.server_info().get("context_length")
            known = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not known:
                log.info("%s reports no context_length: the configured one bounds its requests", self.where)
            self._context = (value if known else None,)
        return self._context[0]

    # --- transport ----------------------------------------------------------------------------------------

    def _call(self, method: str, route: str, body: dict | None = None, timeout: float | None = None) -> Any:
        """One HTTP call; the decoded JSON answer (None for an empty body)."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        # The run's timeline: what each server was asked to do and when (GETs are polls, not work).
        with timeline.span(route[1:], server=self.name, overlap=True) if method == "POST" else nullcontext():
            status, raw = self._exchange(method, route, data, headers, timeout or self.timeout)
        if status >= 400:
            raise GenServerError(self.where, route, status, _error_message(raw))
        try:
            return orjson.loads(raw) if raw.strip() else None  # a rollout's answers: 3x faster than json's
        except orjson.JSONDecodeError:
            return {"message": raw.decode(errors="replace")}  # SGLang answers some routes with plain text

    def _exchange(
        self, method: str, route: str, data: bytes | None, headers: dict, timeout: float
    ) -> tuple[int, bytes]:
        """The status and body of one request on this thread's connection. A kept connection that is reset or
        hung up is taken for one the server closed while it was idle (uvicorn does after 5 s), before the
        request reached it: the request goes once more, on a new connection, whose failure is the call's."""
        while True:
            conn = getattr(self._local, "conn", None)
            kept = conn is not None
            if conn is None:
                conn = self._local.conn = self._connect(timeout)
            elif conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, route, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
                self._drop(conn)
                if kept and isinstance(exc, STALE):
                    continue
                raise GenServerError(self.where, route, None, str(getattr(exc, "reason", exc))) from exc
            if response.will_close:
                self._drop(conn)
            return response.status, raw

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return kind(parts.hostname, parts.port, timeout=timeout)


def n_prompts(prompts) -> int:
    """How many prompts a /generate body asks for: a list of id lists, or of texts, is a batch."""
    batched = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    return len(prompts) if batched else 1


def _error_message(raw: bytes) -> str:
    """The message of an error body: SGLang's ``{"error": {"message"}}``, ``{"message"}``, or the raw text."""
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "error_message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text
