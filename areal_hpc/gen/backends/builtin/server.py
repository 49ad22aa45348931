"""The built-in generation server: SGLang's HTTP API over the batched ``Engine``, stdlib ``http.server`` only.

Routes (JSON bodies; every route but ``/health*`` needs ``Authorization: Bearer <token>``; top-level fields
a route does not use are ignored, as SGLang ignores them)::

    POST /generate                  SGLang's generate (input_ids or text, sampling_params, return_logprob, rid,
                                    return_routed_experts: honoured with --enable-return-routed-experts)
    POST /update_weights_from_disk  {"model_path", "abort_all_requests", "weight_version"}: an HF directory;
                                    one with a manifest.json (our snapshots) must match it, else 400
    POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
                                    "group_name", "backend", "timeout_secs" (ours; SGLang has none)}
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name", "weight_version",
                                    "flush_cache", "abort_all_requests", "load_format"}
    POST /update_weights_from_tensor  {"serialized_named_tensors" (one entry: weights/shared.py), "load_format"
                                    (null), "weight_version", "flush_cache", "abort_all_requests"}
    POST /destroy_weights_update_group  {"group_name"}
    POST /abort_request             {"rid"} or {"abort_all": true}
    POST /pause_generation          {"mode": "abort" | "in_place" | "retract"}: abort ends running requests;
                                    in_place keeps them with their KV cache; retract drops their KV cache and
                                    recomputes it (prompt + output so far) on continue, under the weights then
    POST /continue_generation
    POST /release_memory_occupation {"tags": ["weights", "kv_cache", "cuda_graph"] or null (all)}: only while
                                    idle; the weights' storage is freed and /generate refused meanwhile
    POST /resume_memory_occupation  {"tags"}: resumed weights hold no values; /generate waits for an update
    POST|GET /flush_cache           forget the prefix cache; 400 while requests run (as SGLang)
    POST /load_lora_adapter         {"lora_name", "lora_path"}: a PEFT folder (--enable-lora; one adapter at a
                                    time: lora.py); /generate's lora_path names it
    POST /unload_lora_adapter       {"lora_name"}; both answer {"success", "error_message", "loaded_adapters"}
    POST /update_weight_version     {"new_version", "abort_all_requests" (true)}
    GET  /health, /health_generate  200 while serving, 503 when the engine stopped
    GET  /model_info, /server_info  (also under SGLang's older names /get_model_info, /get_server_info)

Usage::

    python -m areal_hpc.gen.backends.builtin.server --model-path P --token-file RUN/secret [--host 127.0.0.1] [--port 0]
        [--address-file A] [--seed S] [--max-batch-size N] [--device cpu] [--dtype float32]
        [--mem-fraction-static F] [--context-length N] [--enable-return-routed-experts]
        [--enable-lora --max-lora-rank R --lora-target-modules all|q_proj ...]

The three weight updates take SGLang's default abort_all_requests (false): running requests finish first,
unless generation is paused (then they continue on the new weights).

Once it serves, ``{"url", "pid"}`` is written to the address file (``gen.discovery``, tmp + rename); SIGTERM or
SIGINT stop it cleanly (in-flight requests answer with finish reason abort) and remove that file. The gen_server
role starts it in its own process with ``start(spec)`` instead (areal_hpc.gen.backends).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hmac
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import torch

from areal_hpc.control import timeline
from areal_hpc.gen import discovery
from areal_hpc.gen.backends import ServerSpec
from areal_hpc.gen.backends.builtin.engine import Engine, Request
from areal_hpc.gen.backends.builtin.lora import ALL
from areal_hpc.gen.backends.builtin.protocol import (
    RequestError,
    SamplingParams,
    format_output,
    parse_generate,
)
from areal_hpc.weights import FLATTENED, AdapterError, FieldError, ReceiverGroups, metas_from_fields, shared

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
PUBLIC_ROUTES = {"/health", "/health_generate"}  # as SGLang's: they never need the key
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
ABORT_ALL_DEFAULT = False  # SGLang's abort_all_requests for every weight-update route (io_struct.py)
WEIGHT_SYNC_TIMEOUT_S = 300.0  # a weight group's waits, unless /init_weights_update_group gives timeout_secs


class ServerSetupError(RuntimeError):
    """The server cannot start (bad token file, address file, ...); the message says what to fix."""


def read_token(path: str | os.PathLike) -> str:
    """The bearer token in ``path``; refused unless the file is private to its owner (no group/other bits)."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise ServerSetupError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if mode & 0o077:
        raise ServerSetupError(
            f"token file {path} has mode {mode:04o}: it must not be accessible by group or others "
            f"(run: chmod 600 {path})"
        )
    token = path.read_text().strip()
    if not token:
        raise ServerSetupError(f"token file {path} is empty")
    return token


class App:
    """The route handlers: each takes the JSON body and returns (HTTP status, JSON payload)."""

    def __init__(self, engine: Engine, server_args: dict):
        self.engine, self.server_args = engine, server_args
        self.weight_groups = ReceiverGroups(engine.device)
        tok = engine.tokenizer
        self.encode = (lambda text: tok(text)["input_ids"]) if tok is not None else None
        self.decode = (
            (lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)) if tok is not None else None
        )
        self.routes: dict[tuple[str, str], Callable[[dict], tuple[int, Any]]] = {
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
            ("POST", "/init_weights_update_group"): self.init_weights_update_group,
            ("POST", "/update_weights_from_distributed"): self.update_weights_from_distributed,
            ("POST", "/update_weights_from_tensor"): self.update_weights_from_tensor,
            ("POST", "/destroy_weights_update_group"): self.destroy_weights_update_group,
            ("POST", "/abort_request"): self.abort_request,
            ("POST", "/pause_generation"): self.pause_generation,
            ("POST", "/continue_generation"): self.continue_generation,
            ("POST", "/release_memory_occupation"): self.release_memory_occupation,
            ("POST", "/resume_memory_occupation"): self.resume_memory_occupation,
            ("POST", "/load_lora_adapter"): self.load_lora_adapter,
            ("POST", "/unload_lora_adapter"): self.unload_lora_adapter,
            ("POST", "/update_weight_version"): self.update_weight_version,
            ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/flush_cache"): self.flush_cache,
            ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_server_info"): self.server_info,
        }

    def generate(self, body: dict) -> tuple[int, Any]:
        req = parse_generate(body, self.encode)
        groups = [(req.rid[i], [p]) for i, p in enumerate(req.prompts)] if isinstance(req.rid, list) else []
        requests: list[Request] = []
        try:
            for rid, prompts in groups or [(req.rid, req.prompts)]:
                requests.append(
                    self.engine.submit(prompts, req.params, rid, req.return_routed_experts, req.lora_path)
                )
        except Exception:
            for request in requests:  # all or nothing
                self.engine.abort(request.rid)
            raise
        outputs = [out for request in requests for out in self._wait(request)]
        with timeline.span("respond", overlap=True, samples=len(outputs)):
            results = [
                format_output(o, self.decode, req.return_logprob, req.return_text_in_logprobs)
                for o in outputs
            ]
        return 200, results if req.batched else results[0]

    def _wait(self, request: Request) -> list:
        while not request.done.wait(1.0):
            if not self.engine.alive:
                raise RuntimeError(f"the generation engine stopped before request {request.rid} finished")
        return request.outputs

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("model_path", "missing: the HF directory holding the new weights")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise RequestError("load_format", f"unsupported here: {body['load_format']!r}")
        abort_all = _flag(body, "abort_all_requests", ABORT_ALL_DEFAULT)
        try:
            version = self.engine.update_weights(path, body.get("weight_version"), abort_all=abort_all)
        except Exception as exc:  # whatever the loader raises, the caller gets it as the message
            log.warning("weight update from %s failed: %s", path, exc)
            return 400, {"success": False, "message": f"failed to load weights from {path}: {exc}"}
        return 200, {"success": True, "message": f"weights loaded from {path}", "weight_version": version}

    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        """Join the weight group as rank ``rank_offset`` (this server has one rank); blocks until all joined."""
        address = _field(body, "master_address", str)
        if isinstance(body.get("master_port"), str) and body["master_port"].isdigit():  # SGLang coerces it
            body = {**body, "master_port": int(body["master_port"])}
        port, rank, world_size = (_field(body, k, int) for k in ("master_port", "rank_offset", "world_size"))
        name, backend = _group_name(body), body.get("backend", "nccl")
        timeout = body.get("timeout_secs", WEIGHT_SYNC_TIMEOUT_S)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise RequestError("timeout_secs", f"must be a number of seconds > 0, got {timeout!r}")
        try:
            self.weight_groups.init(address, port, rank, world_size, name, backend, float(timeout))
        except Exception as exc:
            log.warning("joining weight group %r failed: %s", name, exc)
            return 400, {"success": False, "message": f"failed to join weight update group {name!r}: {exc}"}
        return 200, {"success": True, "message": f"joined weight update group {name!r} as rank {rank}"}

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        """Receive tensors from rank 0 of the group and swap them in."""
        try:
            metas = metas_from_fields(body.get("names"), body.get("dtypes"), body.get("shapes"))
        except FieldError as exc:
            raise RequestError(exc.field, str(exc)) from None
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED):
            raise RequestError("load_format", f"must be null or {FLATTENED!r}, got {load_format!r}")
        name = _group_name(body)
        abort_all = _flag(body, "abort_all_requests", ABORT_ALL_DEFAULT)
        _flag(body, "flush_cache", True)  # flushed whatever it says: the cache holds the old weights' keys
        receive = lambda: self.weight_groups.receive(name, metas, flattened=load_format == FLATTENED)  # noqa: E731
        try:
            version = self.engine.update_weights_from_tensors(receive, body.get("weight_version"), abort_all)
        except Exception as exc:
            log.warning("weight update from group %r failed: %s", name, exc)
            return 400, {"success": False, "message": f"failed to update weights from group {name!r}: {exc}"}
        message = f"{len(metas)} tensors received from weight update group {name!r}"
        return 200, {"success": True, "message": message, "weight_version": version}

    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        """Copy tensors a process of this host shares (CUDA IPC, shared memory: weights/shared.py) into the
        model."""
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
            raise RequestError(
                "serialized_named_tensors", "must be a list of one base64 string (one TP rank)"
            )
        if body.get("load_format") is not None:
            raise RequestError("load_format", f"must be null here, got {body['load_format']!r}")
        if body.get("disable_draft_model"):
            raise RequestError("disable_draft_model", "this server has no draft model")
        abort_all = _flag(body, "abort_all_requests", ABORT_ALL_DEFAULT)
        _flag(body, "flush_cache", True)  # flushed whatever it says: the cache holds the old weights' keys
        receive = lambda: shared.deserialize(entries[0])  # noqa: E731
        try:
            version = self.engine.update_weights_from_tensors(receive, body.get("weight_version"), abort_all)
        except Exception as exc:
            log.warning("weight update from shared tensors failed: %s", exc)
            return 400, {"success": False, "message": f"failed to update weights from tensors: {exc}"}
        return 200, {"success": True, "message": "shared tensors copied", "weight_version": version}

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        name = _group_name(body)
        if not self.weight_groups.destroy(name):
            return 400, {"success": False, "message": f"there is no weight update group {name!r} to destroy"}
        return 200, {"success": True, "message": f"left weight update group {name!r}"}

    def abort_request(self, body: dict) -> tuple[int, Any]:
        rid, abort_all = body.get("rid"), _flag(body, "abort_all", False)
        if not abort_all and (not isinstance(rid, str) or not rid):
            raise RequestError("rid", "missing: give the request id, or abort_all: true")
        return 200, {"success": True, "aborted": self.engine.abort(rid, abort_all=abort_all)}

    def pause_generation(self, body: dict) -> tuple[int, Any]:
        aborted = self.engine.pause(body.get("mode", "abort"))
        return 200, {"success": True, "message": "generation paused", "aborted": aborted}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        self.engine.resume()
        return 200, {"success": True, "message": "generation continued"}

    def release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        self.engine.release_memory(body.get("tags"))
        return 200, None  # SGLang answers with an empty body

    def resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        self.engine.resume_memory(body.get("tags"))
        return 200, None

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        pages = self.engine.flush_cache()
        return 200, {"success": True, "message": f"cache flushed ({pages} pages of the prefix cache freed)"}

    def load_lora_adapter(self, body: dict) -> tuple[int, Any]:
        name, path = _field(body, "lora_name", str), _field(body, "lora_path", str)
        return self._adapters(lambda: self.engine.adapters.load(name, path, self.engine.device))

    def unload_lora_adapter(self, body: dict) -> tuple[int, Any]:
        name = _field(body, "lora_name", str)
        return self._adapters(lambda: self.engine.adapters.unload(name))

    def _adapters(self, change: Callable[[], dict]) -> tuple[int, Any]:
        """SGLang's answer to a LoRA route: 200 with the adapters loaded, or 400 saying why not."""
        try:
            return 200, {"success": True, "error_message": "", "loaded_adapters": change()}
        except (AdapterError, OSError) as exc:
            loaded = dict(self.engine.adapters.loaded)
            return 400, {"success": False, "error_message": str(exc), "loaded_adapters": loaded}

    def update_weight_version(self, body: dict) -> tuple[int, Any]:
        version = _field(body, "new_version", str)
        self.engine.set_weight_version(version, _flag(body, "abort_all_requests", True))
        return 200, {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": version,
        }

    def health(self, body: dict) -> tuple[int, Any]:
        return (
            (200, {}) if self.engine.healthy else (503, {"error": {"message": "the engine is not running"}})
        )

    def model_info(self, body: dict) -> tuple[int, Any]:
        engine = self.engine
        return 200, {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
        }

    def server_info(self, body: dict) -> tuple[int, Any]:
        # Objects garbage collections skip (frozen at start) and the full collections run: a full one stops
        # every thread of the server, its engine too.
        gc_info = {
            "frozen_objects": gc.get_freeze_count(),
            "full_collections": gc.get_stats()[2]["collections"],
        }
        return 200, {**self.server_args, **self.engine.info(), "gc": gc_info, "backend": "areal_hpc-builtin"}


def _field(body: dict, key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RequestError(key, f"missing or not a{'n' if kind is int else ''} {kind.__name__}: {value!r}")
    return value


def _group_name(body: dict) -> str:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name:
        raise RequestError("group_name", f"must be a non-empty string, got {name!r}")
    return name


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(key, f"must be true or false, got {value!r}")
    return value


class Handler(BaseHTTPRequestHandler):
    """Dispatches to ``App`` routes: bearer-token check, JSON in and out, errors as JSON naming the field.
    Connections are kept alive between requests (HTTP/1.1; every answer has a Content-Length); without Nagle's
    algorithm, as an answer's headers and body are two writes that would otherwise wait 40 ms for an ACK."""

    server: GenHTTPServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        route = self.server.app.routes.get((method, path))
        if route is None:
            known = any(p == path for _, p in self.server.app.routes)
            return self._error(405 if known else 404, f"{method} {path} is not a route of this server")
        if path not in PUBLIC_ROUTES and not self._authorized():
            return self._error(401, "missing or wrong bearer token (Authorization: Bearer <run secret>)")
        try:
            status, payload = route(self._body() if method == "POST" else {})
        except RequestError as exc:
            return self._error(400, str(exc), exc.field)
        except Exception as exc:
            log.exception("%s %s failed", method, path)
            return self._error(500, f"{type(exc).__name__}: {exc}")
        self._send(status, payload)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.server.token)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise RequestError(None, f"body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(None, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError(None, "the body must be a JSON object")
        return body

    def _error(self, status: int, message: str, field: str | None = None) -> None:
        self.close_connection = True  # the request's body may be unread: the connection cannot carry another
        self._send(status, {"error": {"message": message, "field": field, "code": status}})

    def _send(self, status: int, payload: Any) -> None:
        # orjson: an answer of 8 x 1,024 tokens with logprobs takes 0.5 ms, json.dumps 12 ms, and the 16 answers
        # of a rollout, finished at once, were formatted one after another behind one interpreter lock.
        data = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("%s %s", self.address_string(), format % args)


class GenHTTPServer(ThreadingHTTPServer):
    """One thread per connection; the App and the token travel with the server object."""

    daemon_threads = True
    request_queue_size = 1024  # listen backlog: a rollout opens many connections at once (default 5)

    def __init__(self, address: tuple[str, int], app: App, token: str):
        super().__init__(address, Handler)
        self.app, self.token = app, token.encode()


class BuiltinServer:
    """A started built-in server: the engine's thread and the HTTP server's thread, in this process."""

    def __init__(self, spec: ServerSpec):
        token = read_token(spec.token_file)  # before the slow model load: a bad secret fails fast
        if spec.tp_size != 1:
            raise ServerSetupError(
                f"the built-in server runs on one device, not tensor parallel {spec.tp_size}"
            )
        if spec.device.startswith("cuda"):
            # cuDNN attention builds a plan per new KV length: ~30 ms per decode step on an H200 (10x slower).
            torch.backends.cuda.enable_cudnn_sdp(False)
        if spec.device == "cpu" and spec.cpu_threads > 0:
            torch.set_num_threads(spec.cpu_threads)
        self.engine = Engine(
            spec.model_path, device=spec.device, dtype=spec.dtype, seed=spec.seed,
            max_batch_size=spec.max_running_requests, weight_version=spec.weight_version,
            mem_fraction_static=spec.mem_fraction_static, context_length=spec.context_length,
            max_total_tokens=spec.max_total_tokens, return_routed_experts=spec.enable_return_routed_experts,
            max_lora_rank=spec.max_lora_rank, lora_targets=spec.lora_target_modules,
        ).start()  # fmt: skip
        if spec.device.startswith("cuda"):  # compile and capture now, not in the first rollout
            self.engine.submit([[0, 1, 2]], SamplingParams(max_new_tokens=2, n=2, ignore_eos=True)).wait(600)
        # What is loaded and compiled by now (the model, the tokenizer, torch.compile's and Triton's caches) is
        # left out of every later garbage collection: a full one over it stopped a server for 0.1-0.5 s as a
        # rollout's answers went out. No request is left (a frozen one's cycles would never be collected).
        gc.collect()
        gc.freeze()
        args = {k: v for k, v in dataclasses.asdict(spec).items() if k != "token_file"}
        args.update(
            dtype=str(self.engine.dtype).removeprefix("torch."), context_length=self.engine.context_len
        )
        self.httpd = GenHTTPServer((spec.host, spec.port), App(self.engine, args), token)
        # The address other nodes reach: the host name when bound to every interface.
        self.host = socket.gethostname() if spec.host in ("0.0.0.0", "") else spec.host
        self.port = self.httpd.server_address[1]
        args.update(host=self.host, port=self.port)
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True
        )
        self._thread.start()
        log.info("serving %s at %s (pid %d)", spec.model_path, self.url, os.getpid())

    def alive(self) -> bool:
        return self._thread.is_alive() and self.engine.alive

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.stop()
        log.info("stopped")


def start(spec: ServerSpec) -> BuiltinServer:
    """The backend's entry (areal_hpc.gen.backends): serve `spec` from this process."""
    return BuiltinServer(spec)


def parse_args(argv: list[str] | None = None) -> tuple[ServerSpec, str | None]:
    """The spec, and the address file, of the command line."""
    p = argparse.ArgumentParser(
        prog="python -m areal_hpc.gen.backends.builtin.server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument(
        "--token-file", required=True, help="file holding the bearer token (the run's secret, 0600)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    p.add_argument("--address-file", default=None, help="where to write {url, pid} once serving")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples' random streams")
    p.add_argument("--max-batch-size", type=int, default=256, help="most rows decoded together")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (CPU runs share cores)")
    p.add_argument("--weight-version", default="0", help="weight_version before any update (SGLang: default)")
    p.add_argument(
        "--mem-fraction-static", type=float, default=0.9, help="device share for weights and KV cache"
    )
    p.add_argument(
        "--context-length", type=int, default=None, help="longest prompt + answer (default: model's)"
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="cap on the KV pool's positions (SGLang's flag)"
    )
    p.add_argument(
        "--enable-return-routed-experts", action="store_true",
        help="record each token's routed experts (a mixture of experts) for requests with return_routed_experts",
    )  # fmt: skip
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="the largest adapter rank (with --enable-lora)"
    )
    p.add_argument(
        "--lora-target-modules", nargs="*", choices=[*ALL, "all"], default=None,
        help="the modules adapters may adapt (with --enable-lora; all: every one this engine has)",
    )  # fmt: skip
    ns = p.parse_args(argv)
    if ns.enable_lora != bool(ns.max_lora_rank and ns.lora_target_modules):
        p.error(
            "--enable-lora goes with --max-lora-rank and --lora-target-modules, as SGLang's without --lora-paths"
        )
    targets = tuple(ALL if ns.lora_target_modules == ["all"] else ns.lora_target_modules or ())
    spec = ServerSpec(
        ns.model_path, Path(ns.token_file), ns.host, ns.port, ns.device, dtype=ns.dtype, seed=ns.seed,
        max_running_requests=ns.max_batch_size, weight_version=ns.weight_version, cpu_threads=ns.num_threads,
        mem_fraction_static=ns.mem_fraction_static, context_length=ns.context_length,
        max_total_tokens=ns.max_total_tokens, enable_return_routed_experts=ns.enable_return_routed_experts,
        max_lora_rank=ns.max_lora_rank or 0, lora_target_modules=targets,
    )  # fmt: skip
    return spec, ns.address_file


def main(argv: list[str] | None = None) -> None:
    """The server as a command (tools, tests): serve until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec, address_file = parse_args(argv)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    try:
        server = start(spec)
    except ServerSetupError as exc:
        sys.exit(f"gen server: {exc}")
    try:
        if address_file:
            discovery.announce(Path(address_file), server.url)
        while not stopped.wait(0.2) and server.alive():
            pass
    finally:
        server.stop()
        if address_file:
            discovery.withdraw(Path(address_file))


if __name__ == "__main__":
    main()
