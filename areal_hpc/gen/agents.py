"""An agent trained as it is: the workflow that gives each episode a key to the OpenAI endpoint (gen.endpoint)
and runs the user's agent against it, a Python function (rollout.agent) or a program (rollout.agent_command).

A function is `async def agent(base_url, api_key, record) -> reward` (or a plain `def`); ``record`` is the
prompt's dataset record (data.PromptSample). It runs in a thread of its own, an async one in an event loop of
that thread, so that a blocking call in it holds up its own episode only. A program gets OPENAI_BASE_URL,
OPENAI_API_KEY and OPENAI_MODEL in its environment and the record as one JSON object on its stdin; its reward
is the last line of its stdout, a number, read when it exits.
The program's stdout and stderr are kept per episode, each cut at rollout.agent_output_bytes, in logs/agents/ (a
file per group, named by control.fsio.name_of of the prompt's id).

A program sees only what it needs (docs/agents.md, "What an agent program can and cannot reach"): an environment
of PATH, the locale, the role's OPENAI_* variables and those rollout.agent_env names, its own HOME and TMPDIR;
it runs in mount and PID namespaces of its own (agent.programs), where no other episode's process
(its key) nor the role's is visible, the run directory is an empty tmpfs, and everything it started dies with it,
at its exit or when the episode is given up (rollout.episode_timeout_secs, or the role stops); as root, as a uid
of its own. rollout.agent_isolation=best_effort runs it without the namespaces where the node has none.

An agent that fails (its function raises or returns no finite number, its program exits non-zero or prints
none last) fails its episode: the group is dropped, logged and counted (reason agent_error), and the run goes on.
A reward is never coerced: a string, a bool, NaN or inf is the agent's error.

At most rollout.agent_concurrency episodes of a rollout process run their agent at once (Slots, agent_slots):
an episode waits for its turn before its function is called or its program started.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import numbers
import os
import shlex
import signal
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from pathlib import Path

from areal_hpc.agent import AgentError, ProgramJail, program_env
from areal_hpc.control import fsio
from areal_hpc.gen.client import GenerationStopped
from areal_hpc.gen.endpoint import Endpoint

READ_BYTES = 65536
GRACE_SECS = 1.0  # for a program's output to drain once it exited
PROGRAMS_PER_CPU = 4  # rollout.agent_concurrency's default for programs (agent_slots says why)


def function_agent(fn: Callable, endpoint: Endpoint) -> Callable:
    """The workflow of rollout.agent: the function runs in a thread of its own (see ``in_own_thread``)."""

    async def workflow(ctx, record) -> float:
        key = endpoint.open(ctx)
        try:
            reward = await in_own_thread(fn, endpoint.base_url, key, record)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            cause = f"rollout.agent raised {type(exc).__name__}"
            raise _failure(ctx, f"{cause}: {exc}", cause) from exc
        finally:
            endpoint.close(key)
        return _returned_reward(reward)

    return workflow


async def in_own_thread(fn: Callable, *args) -> object:
    """``fn(*args)`` in a thread of its own, and an async ``fn`` in an event loop of that thread: a blocking call
    in an agent (a sync HTTP client, a sync framework) then stalls only its own episode, never this loop, which
    serves the episode's calls to the endpoint and generates the other episodes of the group. Cancelling the
    await cancels an async agent where it waits; a blocking call returns when the endpoint, which closes the
    episode's key at its end, answers it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    inner: dict = {}  # the agent's loop and task, once they exist

    def settle(outcome: str, value) -> None:
        if not done.done():
            getattr(done, outcome)(value)

    def run() -> None:
        try:
            with asyncio.Runner() as runner:
                value = fn(*args)  # a plain function blocks here, in this thread
                if inspect.isawaitable(value):
                    inner["loop"] = own = runner.get_loop()
                    inner["task"] = task = own.create_task(_awaited(value))
                    value = own.run_until_complete(task)
            loop.call_soon_threadsafe(settle, "set_result", value)
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting episode, which decides)
            with suppress(RuntimeError):  # the episode's loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(settle, "set_exception", exc)

    threading.Thread(target=run, name="agent", daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:
        if "task" in inner:
            with suppress(RuntimeError):
                inner["loop"].call_soon_threadsafe(inner["task"].cancel)
        raise


async def _awaited(awaitable) -> object:
    return await awaitable


def command_agent(
    command: str,
    endpoint: Endpoint,
    logs: Path,
    output_bytes: int,
    *,
    env_names: Sequence[str] = (),
    hidden: Sequence[Path] = (),
    isolation: str = "required",
    attempt: int = 0,
) -> Callable:
    """The workflow of rollout.agent_command; its output goes to ``logs``/epoch<E>/<name_of(prompt)>.log, a block
    per episode (one file per group, not two per episode: shared file systems suffer millions of small files),
    whose header names the run's ``attempt`` (a restart appends to the same files).
    ``env_names``: rollout.agent_env; ``hidden``: what the program must not see (the run directory);
    ``isolation``: rollout.agent_isolation (AgentIsolationError where required and the node cannot isolate)."""
    jail = ProgramJail(shlex.split(command), hidden, isolation)

    async def workflow(ctx, record) -> float:
        key = endpoint.open(ctx)
        where = logs / f"epoch{ctx.epoch}" / f"{fsio.name_of(record.query_id)}.log"
        out, err = Output(output_bytes), Output(output_bytes)
        proc = None
        try:
            with jail.seat() as seat:
                own = {"OPENAI_BASE_URL": endpoint.base_url, "OPENAI_API_KEY": key, "OPENAI_MODEL": endpoint.model,
                       "HOME": str(seat.home), "TMPDIR": str(seat.tmp)}  # fmt: skip
                proc = await jail.start(seat, program_env(os.environ, env_names, own))
                await _converse(
                    proc, out, err, json.dumps(record_fields(record)).encode() + b"\n", jail.isolated
                )
        finally:
            endpoint.close(key)
            head = (f"=== episode {ctx.index} of {record.query_id} (epoch {ctx.epoch}, attempt {attempt}), "
                    f"exit code {proc and proc.returncode}")  # fmt: skip
            _append(where, b"".join([f"{head}: stdout\n".encode(), out.kept(), f"\n{head}: stderr\n".encode(),
                                     err.kept(), b"\n"]))  # fmt: skip
        if proc.returncode != 0:
            cause = f"rollout.agent_command exited with {proc.returncode}"
            raise _failure(ctx, f"{cause} (its output: {where})", cause)
        return _printed_reward(out.tail, where)

    return workflow


def agent_slots(concurrency: int | None, programs: bool) -> Slots | None:
    """The turns of rollout.agent_concurrency in this process (None: no limit). Its default (null) is
    PROGRAMS_PER_CPU programs per CPU this process may run on (os.sched_getaffinity: Slurm's allocation, a
    container's cpuset): a program's start (an interpreter, its imports) takes a CPU for about a second and it
    then mostly waits on the model, so a few per CPU keep the CPUs and the servers busy, where hundreds at once
    start so slowly that every group runs out of time. Functions have no limit by default: they share the
    rollout's interpreter (one CPU's worth), and their cost is their requests, which the servers admit."""
    if concurrency is None:
        concurrency = PROGRAMS_PER_CPU * len(os.sched_getaffinity(0)) if programs else 0
    return Slots(concurrency) if concurrency else None


class Slots:
    """At most ``n`` holders at once, over the event loops of every thread of the process (a group's episodes run
    in a loop of its own), served first come, first served.

        async with slots.turn():   # waits while n others hold one
            ...
    """

    def __init__(self, n: int):
        self.free = n
        self._lock = threading.Lock()
        self._queue: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        await self._take()
        try:
            yield
        finally:
            self._give()

    async def _take(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.free and not self._queue:
                self.free -= 1
                return
            waiter = (loop, loop.create_future())
            self._queue.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:  # given up while it waited: a turn handed to it meanwhile goes on
            with self._lock:
                handed = waiter not in self._queue
                if not handed:
                    self._queue.remove(waiter)
            if handed:
                self._give()
            raise

    def _give(self) -> None:
        """The turn goes to the first waiter (woken in its loop), or back to the free ones."""
        with self._lock:
            if not self._queue:
                self.free += 1
                return
            loop, future = self._queue.popleft()
        with suppress(RuntimeError):  # its loop closed: it was given up, and handed the turn on itself
            loop.call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future) -> None:
    if not future.done():  # not given up meanwhile
        future.set_result(None)


async def _converse(
    proc: asyncio.subprocess.Process, out: Output, err: Output, record_line: bytes, isolated: bool
) -> None:
    """Feed the record and read the output until the program exits; then its output drains for at most
    GRACE_SECS (what it left running might hold its stdout open for ever). The program and all it started are
    killed when the episode is given up; ``isolated``, when it exits too (its namespace's init does it)."""
    io = asyncio.ensure_future(
        asyncio.gather(out.read(proc.stdout), err.read(proc.stderr), _feed(proc.stdin, record_line))
    )
    try:
        await proc.wait()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(io), GRACE_SECS)
    finally:
        # Its process group: unshare and the namespace's init (whose death kills the namespace), or, without
        # namespaces, the program and what it started in its group. After a normal exit the group's id stays
        # reserved while any of them lives, so no other process can be hit; isolated, none lives.
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        elif not isolated:
            _kill_group(proc.pid)
        io.cancel()
        await asyncio.wait({io})


def _kill_group(pgid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class Output:
    """A program's stream as it is read: its first ``limit`` bytes and its last 4 KiB (what was read stays
    when the episode is given up midway)."""

    def __init__(self, limit: int):
        self.limit, self.head, self.tail, self.total = limit, bytearray(), b"", 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(READ_BYTES):
            self.total += len(chunk)
            self.head += chunk[: max(0, self.limit - len(self.head))]
            self.tail = (self.tail + chunk)[-4096:]

    def kept(self) -> bytes:
        cut = self.total - len(self.head)
        return bytes(self.head) + (f"\n[cut: {cut} more bytes]\n".encode() if cut else b"")


def _append(path: Path, data: bytes) -> None:
    """One write, so that the blocks of a group's episodes never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with suppress(BrokenPipeError, ConnectionResetError):  # a program need not read its record
        stdin.write(data)
        await stdin.drain()
        stdin.close()


def _failure(ctx, message: str, cause: str) -> Exception:
    """What an agent's failure is: the agent's own (AgentError: its group is dropped), or, when the endpoint
    could not serve it (a server failed, the role stops), that cause, which the rollout handles as it handles any
    workflow's: the group is not dropped and its journals stay for a resume."""
    stop = ctx.services.stop
    if stop is not None and stop.is_set():
        return GenerationStopped(f"the role stops: {message}")
    return ctx.failure or AgentError(message, cause)


def _returned_reward(value) -> float:
    """A function's reward: a finite number. None, a string, a bool, NaN or inf is its error, never coerced (a
    string or a bool would be read as a number, NaN would reach the advantages)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
        raise AgentError(f"rollout.agent returned {float(value)}, not a finite number (the reward)")
    shown = "None" if value is None else f"a {type(value).__name__}"
    cause = f"rollout.agent returned {shown}, not a number (the reward)"
    raise AgentError(cause if value is None else f"{cause}: {value!r:.80}", cause)


def _printed_reward(tail: bytes, where: Path) -> float:
    """A program's reward: the last line of its stdout (``tail``), a finite number; text, NaN or inf is its
    error."""
    lines = tail.decode(errors="replace").strip().splitlines()
    last = lines[-1].strip() if lines else ""
    try:
        reward = float(last)
    except ValueError:
        reward = math.nan
    if math.isfinite(reward):
        return reward
    if not last:
        cause = "rollout.agent_command printed nothing (the last line of its stdout is the reward)"
        raise AgentError(f"{cause} (its output: {where})", cause)
    cause = "the last line of rollout.agent_command's stdout is not a finite number (the reward)"
    raise AgentError(f"{cause}: {last!r:.80} (its output: {where})", cause)


def record_fields(record) -> dict:
    """The dataset record an agent program reads: the prompt, its id, its task and answers, its other fields."""
    out = {**(record.fields or {}), "query_id": record.query_id, "prompt": record.prompt, "task": record.task,
           "solutions": list(record.solutions)}  # fmt: skip
    if record.messages:
        out["messages"] = list(record.messages)
    return out
