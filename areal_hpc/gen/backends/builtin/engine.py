"""The generation engine: one thread that runs every request's rows through the scheduler.

HTTP threads call ``submit`` (queue rows, get a ``Request`` to wait on) and the control methods (abort, pause,
continue, weight update); controls run on the engine thread between two forward passes, so the batch and the
model are only ever touched by that thread. Each sample of a request is a row with its own random stream
(``sampling_seed`` + sample index, or a seed drawn from the server's seeded generator at submission), so its
draws do not depend on which requests it was batched with (its logits can, in their last bits: see
``sampling``). The pieces: ``scheduler`` (rows and slots), ``runner`` (prefill and decode steps, CUDA
graphs), ``cache`` (the KV cache), ``model`` (the decoder's weights and forward; ``moe`` the experts of a
mixture), ``sampling`` and ``loading`` (tokenizer, EOS ids).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

from areal_hpc.control import MANIFEST, verify_snapshot
from areal_hpc.gen.backends.builtin import cache
from areal_hpc.gen.backends.builtin.loading import eos_token_ids, load_tokenizer, resolve_dtype
from areal_hpc.gen.backends.builtin.lora import Adapters
from areal_hpc.gen.backends.builtin.model import Decoder, Shape
from areal_hpc.gen.backends.builtin.protocol import RequestError, SamplingParams
from areal_hpc.gen.backends.builtin.runner import Runner
from areal_hpc.gen.backends.builtin.scheduler import Row, Scheduler
from areal_hpc.weights import AdapterError

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")  # SGLang's
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's; no tags: all of them
CONTROL_TIMEOUT_S = 120.0
# An idle engine admits a burst of requests once none came for SETTLE_QUIET_S (at most SETTLE_MAX_S after it
# woke): the groups a rollout sends together then share one prefill and end together.
SETTLE_QUIET_S, SETTLE_MAX_S = 0.005, 0.05


@dataclass
class Output:
    """The result of one sample: what SGLang's response object carries."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    prompt_tokens: int
    cached_tokens: int  # context tokens its prefills took from the prefix cache (SGLang's meta_info field)
    weight_version: str
    latency: float
    skip_special_tokens: bool
    routed_experts: np.ndarray | None = None  # [prompt + output - 1, layers, k] int32, when asked for


class Request:
    """A submitted request: its rows (prompt-major, n samples each) and an event set when all are finished."""

    def __init__(self, rid: str, rows: list[Row]):
        self.rid, self.rows, self.created = rid, rows, time.monotonic()
        self.pending = len(rows)
        self.outputs: list[Output] = []
        self.done = threading.Event()

    def wait(self, timeout: float | None = None) -> list[Output]:
        """Block until every row is finished (aborted rows included); TimeoutError after ``timeout`` s."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"generation request {self.rid} not finished after {timeout} s")
        return self.outputs


class Engine:
    """Batched sampler behind the built-in server; see the module docstring for the threading contract."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        seed: int = 0,
        max_batch_size: int = 256,
        weight_version: str = "0",
        mem_fraction_static: float = 0.9,
        context_length: int | None = None,
        max_total_tokens: int | None = None,
        return_routed_experts: bool = False,
        max_lora_rank: int = 0,
        lora_targets: tuple[str, ...] = (),
    ):
        self.model_path, self.tokenizer_path = str(model_path), str(tokenizer_path or model_path)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.seed, self.max_batch_size, self.weight_version = seed, max_batch_size, str(weight_version)
        decoder = Decoder.from_pretrained(self.model_path, self.device, self.dtype)
        if max_lora_rank:  # SGLang's --enable-lora: room for adapters, before any graph is captured
            decoder.enable_lora(max_lora_rank, lora_targets)
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        config = decoder.config
        self.vocab_size = config.vocab_size
        model_len = config.max_position_embeddings
        self.context_len = min(context_length or model_len, model_len)
        budget = cache.budget_bytes(self.device, mem_fraction_static, decoder.nbytes)
        # No more positions than max_batch_size rows at full context can use (nor than SGLang's max_total_tokens).
        cap = min(max_batch_size * self.context_len, max_total_tokens or max_batch_size * self.context_len)
        self.plan = cache.plan(decoder.shape, self.dtype, budget, self.context_len, cap)
        log.info("KV cache: %s", json.dumps(self.plan.describe()))
        self.eos_ids = eos_token_ids(self.model_path, config, self.tokenizer)
        # SGLang's --enable-return-routed-experts: every forward records the experts chosen (a dense model: error).
        self.records_routed = return_routed_experts
        runner = Runner(decoder, max_batch_size, self.plan, record=return_routed_experts)
        self._sched = Scheduler(runner, self.context_len)
        self._seeds = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: deque[Row] = deque()
        self._requests: dict[str, Request] = {}  # unfinished requests by rid
        self._controls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._paused = self._stopping = False
        self._draining = False  # a weight update waits for running rows: admit none meanwhile
        self._last_submit = 0.0  # time.monotonic() of the last request queued
        self._released: set[str] = set()  # memory tags given back (colocated: the trainers use it meanwhile)
        self._stale = False  # the weights' memory came back without its contents: serve none until an update
        self._update_lock = threading.Lock()  # one weight load at a time
        self.adapters = Adapters(decoder.lora, self._between_steps)  # LoRA (lora.py)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="gen-engine", daemon=True)

    @property
    def _decoder(self) -> Decoder:
        return self._sched.runner.decoder

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything still running or queued and end the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs (after ``stop`` it still finishes the requests it holds)."""
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """True while the engine thread serves requests."""
        return self._thread.is_alive() and self.error is None and not self._stopping

    # --- requests -----------------------------------------------------------------------------------------

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, rid: str | None = None, routed: bool = False,
        adapter: str | None = None,
    ) -> Request:  # fmt: skip
        """Queue ``prompts`` x ``params.n`` rows under one request id; RequestError names a bad field. ``routed``:
        return each sample's routed experts (only when the engine records them, as SGLang ignores it else).
        ``adapter``: the LoRA adapter it names (SGLang's lora_path)."""
        if not prompts or not all(prompts):
            raise RequestError("input_ids", "missing input: every prompt needs at least one token")
        try:
            self.adapters.check_request(adapter)
        except AdapterError as exc:
            raise RequestError("lora_path", str(exc)) from None
        for i, prompt in enumerate(prompts):
            if max(prompt) >= self.vocab_size:
                raise RequestError("input_ids", f"token id {max(prompt)} >= vocab size {self.vocab_size}")
            self._check_fits(i, len(prompt), params.max_new_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        with self._cond:
            if not self.healthy:
                raise RuntimeError("the generation engine is not running")
            if why := self._unready():
                raise RequestError(None, f"the server cannot generate: {why}")
            rid = rid or uuid.uuid4().hex
            if rid in self._requests:
                raise RequestError("rid", f"{rid!r} is already in use by an unfinished request")
            keep = routed and self.records_routed
            rows = [
                Row(prompt, params, stop_ids, self._row_seed(params, k), routed=[] if keep else None)
                for k, prompt in enumerate(p for p in prompts for _ in range(params.n))
            ]
            request = Request(rid, rows)
            for row in rows:
                row.owner = request
            self._requests[rid] = request
            self._waiting.extend(rows)
            self._last_submit = time.monotonic()
            self._cond.notify_all()
        return request

    def _check_fits(self, index: int, prompt: int, max_new: int | None) -> None:
        """Refuse a sequence the server can never hold, as SGLang refuses one over its context, never cut it."""
        if prompt >= self.context_len:
            raise RequestError(
                "input_ids", f"prompt {index} has {prompt} tokens, the context length is {self.context_len}"
            )
        if max_new is not None and prompt + max_new > self.context_len:
            raise RequestError(
                "max_new_tokens",
                f"prompt {index} of {prompt} tokens + max_new_tokens {max_new} = {prompt + max_new} exceeds the "
                f"context length {self.context_len}: lower max_new_tokens or raise the context length",
            )
        longest = prompt + (max_new if max_new is not None else self.context_len - prompt)
        if longest > self.plan.tokens:
            raise RequestError(
                "max_new_tokens",
                f"prompt {index} of {prompt} tokens may grow to {longest}, more than the KV cache's "
                f"{self.plan.tokens} positions ({self.plan.gib:.2f} GiB): lower max_new_tokens or raise "
                "mem_fraction_static",
            )

    def _row_seed(self, params: SamplingParams, sample: int) -> int:
        """The seed of one sample's stream (called under the lock, so server seeds are drawn in order)."""
        seed = params.sampling_seed
        return seed + sample if seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))

    # --- controls (run on the engine thread between forward passes) ---------------------------------------

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Finish request ``rid`` (or every request) now with finish reason abort; returns how many."""
        if abort_all:
            return self._call(lambda: self._abort_now(lambda req: True, "aborted by abort_all"))
        return self._call(lambda: self._abort_now(lambda req: req.rid == rid, "aborted by request"))

    def pause(self, mode: str = "abort") -> int:
        """Stop scheduling, as SGLang's modes do: abort finishes in-flight requests (returns how many);
        in_place keeps running rows with their KV cache; retract drops their KV cache and queues them first,
        so that on continue a prefill of prompt + output so far recomputes it (with the weights of then)."""
        if mode not in PAUSE_MODES:
            raise RequestError("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")

        def pause_now() -> int:
            self._paused = True
            if mode == "retract":
                self._retract()
            return self._abort_now(lambda req: True, "generation paused") if mode == "abort" else 0

        return self._call(pause_now)

    def _retract(self) -> None:
        finished, rows = self._sched.retract()
        self._finish(finished)
        with self._cond:
            self._waiting.extendleft(reversed(rows))

    def resume(self) -> None:
        """Continue after ``pause``."""
        self._call(lambda: setattr(self, "_paused", False))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give back the memory of ``tags`` (SGLang's release_memory_occupation), only while idle: the weights,
        the KV cache and the CUDA graphs (which point at both; rotary tables are kept, as SGLang keeps its
        static state). Generation is refused until it is resumed."""
        tags = _memory_tags(tags)

        def release() -> None:
            if self._sched.rows or self._waiting:
                raise RequestError(
                    None, "release_memory_occupation needs an idle server: requests are running"
                )
            new = set(tags) - self._released
            if "kv_cache" in new:
                self._sched.flush_cache()
            self._sched.runner.release(weights="weights" in new, cache="kv_cache" in new)
            self._released |= set(tags)

        self._call(release)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` released before (SGLang's resume_memory_occupation); resumed
        weights hold no values until the next weight update."""
        tags = _memory_tags(tags)

        def resume() -> None:
            if not set(tags) <= self._released:
                raise RequestError("tags", f"{sorted(set(tags) - self._released)} not released")
            self._sched.runner.resume(weights="weights" in tags, cache="kv_cache" in tags)
            if "weights" in tags:
                self._stale = True
            self._released -= set(tags)

        self._call(resume)

    def flush_cache(self) -> int:
        """Forget the prefix cache, only while idle (SGLang's /flush_cache refuses while requests run); returns
        the pages it freed."""

        def flush() -> int:
            if self._sched.rows or self._waiting:
                raise RequestError(None, "flush_cache needs an idle server: requests are running")
            return self._sched.flush_cache()

        return self._call(flush)

    def _unready(self) -> str | None:
        """Why generation is refused now (a colocated server between turns), or None."""
        if self._released:
            return (
                f"its {', '.join(sorted(self._released))} memory is released: resume_memory_occupation first"
            )
        if self._stale:
            return "its weights' memory came back without weights: update them first"
        return None

    @property
    def memory(self) -> dict:
        """What the server holds: the tags released, and whether its weights wait for an update."""
        held = self._decoder.nbytes
        return {"released": sorted(self._released), "weights_stale": self._stale, "weights_bytes": held}

    def update_weights(self, model_path: str, weight_version: Any = None, abort_all: bool = True) -> str:
        """Load new weights from an HF directory between two decode steps; returns the version. A snapshot of
        ours is checked against its manifest first (a plain HF directory, as SGLang takes, loads as it is);
        the files are read into the weights in place (CUDA graphs keep pointing at them)."""

        def load() -> Callable[[], None]:
            if (Path(model_path) / MANIFEST).exists():
                verify_snapshot(model_path)
            shape = Shape.of(AutoConfig.from_pretrained(model_path))
            if shape != self._decoder.shape:
                raise ValueError(
                    f"{model_path} holds a model of another shape: {shape}, serving {self._decoder.shape}"
                )

            def apply() -> None:
                try:
                    self._decoder.load(str(model_path))
                except BaseException:
                    # A failure half way leaves no usable weights: serve none until an update.
                    self._stale = True
                    raise
                self.model_path = str(model_path)

            return apply

        return self._update(load, weight_version, abort_all)

    def update_weights_from_tensors(
        self,
        receive: Callable[[], list[tuple[str, torch.Tensor]]],
        weight_version: Any = None,
        abort_all: bool = True,
    ) -> str:
        """Copy named tensors (HF state-dict names) into the model between two decode steps; returns the version.

        ``receive()`` runs off the engine thread (generation goes on while tensors arrive); names must be in
        the model's state dict with the same shapes, and are checked before anything is copied. Tied weights
        may come under each of their names: each copy writes the one shared tensor.
        """

        def load() -> Callable[[], None]:
            named = receive()
            params = self._decoder.named()
            unknown = [name for name, _ in named if name not in params]
            if unknown:
                raise KeyError(f"the model has no weights named {unknown[:5]} ({len(unknown)} unknown)")
            for name, tensor in named:
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(params[name].shape)}"
                    )

            def apply() -> None:
                with torch.no_grad():
                    for name, tensor in named:
                        params[name].copy_(tensor)

            return apply

        return self._update(load, weight_version, abort_all)

    def _update(self, load: Callable[[], Callable[[], None]], weight_version: Any, abort_all: bool) -> str:
        """One weight update at a time: ``load()`` off the engine thread, then its result applied on it.

        As SGLang: without abort_all, running requests finish first and new ones wait, unless generation is
        paused (then the update goes ahead, and paused requests continue on the new weights); the version is
        the one sent, else the current one."""
        if "weights" in self._released:
            raise RequestError(None, "the weights' memory is released: resume_memory_occupation first")
        with self._update_lock:
            try:
                if not abort_all and not self._paused:
                    self._drain()
                apply = load()  # slow: reading files or receiving tensors

                def swap() -> str:
                    if abort_all:
                        self._abort_now(lambda req: True, "aborted for a weight update")
                    apply()
                    self._sched.flush_cache()  # cached keys and values are the old weights'
                    self._stale = False
                    if weight_version is not None:
                        self.weight_version = str(weight_version)
                    return self.weight_version

                return self._call(swap)
            finally:  # a failed load too: requests are admitted again
                with self._cond:
                    self._draining = False
                    self._cond.notify_all()

    def _between_steps(self, fn: Callable[[], None]) -> None:
        """``fn()`` on the engine thread between two steps, then the prefix cache dropped (an adapter loaded or
        unloaded: the cached keys and values are another policy's); one such change or weight load at a time."""
        with self._update_lock:
            self._call(lambda: (fn(), self._sched.flush_cache()))

    def set_weight_version(self, version: str, abort_all: bool) -> None:
        """Report ``version`` from now on (SGLang's /update_weight_version); ``abort_all``: running requests
        end first, with finish reason abort and what they have."""

        def swap() -> None:
            if abort_all:
                self._abort_now(lambda req: True, "aborted for a weight version update")
            self.weight_version = str(version)

        self._call(swap)

    def _drain(self, poll: float = 0.01) -> None:
        """Stop admitting rows and wait until the running ones have finished."""
        self._call(lambda: setattr(self, "_draining", True))
        while self._sched.rows and self.healthy:
            time.sleep(poll)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread at the next step boundary and return its result."""
        future: Future = Future()
        with self._cond:
            if not self.healthy:
                raise RuntimeError("the generation engine is not running")
            self._controls.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout=CONTROL_TIMEOUT_S)

    def _abort_now(self, match: Callable[[Request], bool], message: str) -> int:
        with self._cond:
            queued = [row for row in self._waiting if match(row.owner)]
            self._waiting = deque(row for row in self._waiting if not match(row.owner))
        for row in queued:
            row.abort(message)
        running = self._sched.abort(lambda row: match(row.owner), message)
        self._finish(queued + running)
        return len({id(row.owner) for row in queued + running})

    # --- the engine thread --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._step()
        except BaseException as exc:  # a crashed engine must fail its requests, not leave them hanging
            log.exception("generation engine failed")
            self.error = exc
        self._run_controls()
        self._abort_now(lambda req: True, f"engine stopped: {self.error or 'server shutting down'}")
        log.info("engine counters: %s", json.dumps(dict(self._sched.stats)))
        with self._cond:
            controls, self._controls = list(self._controls), deque()
        for _, future in controls:
            future.set_exception(RuntimeError("the generation engine stopped"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._has_work():
                self._cond.wait()
            return not self._stopping

    def _has_work(self) -> bool:
        admit = bool(self._waiting) and not self._draining
        return bool(self._controls) or (not self._paused and (admit or bool(self._sched.rows)))

    def _step(self) -> None:
        """Run pending controls, admit waiting rows into free slots, then decode one token for the batch."""
        if self._controls:
            self._finish(self._sched.flush())  # controls see every launched step read
            self._run_controls()
        with self._cond:
            if self._paused:
                self._finish(self._sched.flush())
                return
            if not self._sched.rows:
                self._settle()
            free = 0 if self._draining else max(self.max_batch_size - len(self._sched.rows), 0)
            candidates = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        finished, left = self._sched.admit(candidates) if candidates else ([], [])
        stepped, retracted = self._sched.step()
        with self._cond:  # rows the pool cannot hold now wait first in line, retracted ones before them
            self._waiting.extendleft(reversed(retracted + left))
        self._finish(finished + stepped)

    def _settle(self) -> None:
        """Wait (the lock held, released while waiting) until requests stop arriving: without it the first
        request of a burst is prefilled alone, the rest join steps later and end as much later."""
        deadline = time.monotonic() + SETTLE_MAX_S
        while not (self._stopping or self._controls or self._paused):
            wait = min(self._last_submit + SETTLE_QUIET_S, deadline) - time.monotonic()
            if wait <= 0:
                return
            self._cond.wait(wait)

    def _run_controls(self) -> None:
        with self._cond:
            controls, self._controls = list(self._controls), deque()
        for fn, future in controls:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _finish(self, rows: list[Row]) -> None:
        """Count finished rows against their requests and complete the requests whose rows are all done."""
        with self._cond:
            for row in rows:
                request = row.owner
                request.pending -= 1
                if request.pending == 0:
                    self._complete(request)

    def _complete(self, request: Request) -> None:
        latency = time.monotonic() - request.created
        request.outputs = [
            Output(
                rid=request.rid if len(request.rows) == 1 else f"{request.rid}-{i}",
                output_ids=row.output_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason,
                prompt_tokens=len(row.prompt),
                cached_tokens=row.cached_tokens,
                weight_version=self.weight_version,
                latency=latency,
                skip_special_tokens=row.params.skip_special_tokens,
                routed_experts=_routed_experts(row),
            )
            for i, row in enumerate(request.rows)
        ]
        del self._requests[request.rid]
        request.done.set()

    # --- introspection ------------------------------------------------------------------------------------

    def info(self) -> dict:
        """State and counters for /server_info."""
        running = {id(row.owner) for row in self._sched.rows}
        with self._cond:
            return {
                "weight_version": self.weight_version,
                "model_path": self.model_path,
                "tokenizer_path": self.tokenizer_path,
                "num_running_reqs": len(running),
                "num_queued_reqs": len(self._requests) - len(running),
                "paused": self._paused,
                "memory": self.memory,
                "healthy": self.healthy,
                "stats": dict(self._sched.stats),
                "kv_cache": self.plan.describe() | self._sched.pool(),
                "max_total_num_tokens": self.plan.tokens,  # SGLang's field: positions of the KV pool
                "context_length": self.context_len,  # SGLang's field: the longest prompt + answer served
            }


def _routed_experts(row: Row) -> np.ndarray | None:
    """The experts chosen for every token a forward took: the prompt and each output but the last (SGLang's
    shape); None when not asked for, or when the row never ran."""
    if not row.routed:
        return None
    return np.concatenate(row.routed)[: len(row.prompt) + len(row.output_ids) - 1]


def _memory_tags(tags: list[str] | None) -> list[str]:
    """SGLang's tags of release/resume_memory_occupation: none or empty means all."""
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
        raise RequestError("tags", f"must be a list of {', '.join(MEMORY_TAGS)}, got {tags!r}")
    return tags
