"""The weight group: a torch.distributed process group of its own between the publishing trainer rank (rank 0)
and every generation server rank (1..n), as SGLang's ``/init_weights_update_group`` builds it.

It is made from a ``TCPStore`` that trainer rank 0 hosts at ``master_address:master_port`` and a backend object
constructed directly (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU, chosen by a string), so it
needs no default process group and does not touch the trainer's: the server process has none, the trainer's
default group keeps its own ranks. Only broadcasts from rank 0 are used.

Every wait is bounded: joining by the store's timeout, each broadcast by polling its work object against a
deadline. A timeout raises ``GroupTimeout`` naming the group, its size and the seconds; after any failure the
group is unusable (its peers may be mid-broadcast) and must be destroyed and made again.

gloo picks its network interface from the host name; set ``GLOO_SOCKET_IFNAME`` where that is wrong.
gloo's group is made when every rank has joined; NCCL's communicator only at the first broadcast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# The backend's own op timeout is ours plus this: our message surfaces first. Freeing a gloo group with an op
# pending waits for gloo's timeout (keep it short); NCCL's watchdog must not act before we abort the op.
MARGIN_S = {"gloo": 2.0, "nccl": 30.0}
# Our own timeouts bound every wait of these groups: no NCCL heartbeat monitor (it would kill the process).
# torch 2.11 still runs its thread for dump checks: it logs a warning when rank 0's store goes away first.
NCCL_ENV = {"TORCH_NCCL_ENABLE_MONITORING": "0"}
_GRAVEYARD: list = []  # backends of failed groups: never freed while we run (see WeightGroup.destroy)


@contextlib.contextmanager
def _env(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class GroupError(RuntimeError):
    """The weight group failed (a peer left, a transport error); the message names the group."""


class GroupTimeout(GroupError, TimeoutError):
    """A wait of the weight group ran out of time; the message names the group, the peers and the seconds."""


def host_store(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """The group's store, served by this process (trainer rank 0) on ``port`` (0: any free port).

    ``store.port`` is the port it listens on, on every interface.
    """
    return dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def connect_store(master_address: str, master_port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``master_address:master_port`` (the server side)."""
    return dist.TCPStore(master_address, master_port, None, False, timedelta(seconds=timeout_s))


def _make_backend(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float):
    if backend == "gloo":  # this timeout bounds the join; each broadcast passes its own (see broadcast)
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    if backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise GroupError("backend nccl needs CUDA and a torch built with NCCL; use gloo on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=timeout_s + MARGIN_S["nccl"])
        with _env(NCCL_ENV):  # read when the group is made
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise GroupError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")


class WeightGroup:
    """This process's membership of weight group ``name``: ``rank`` of ``world_size``, over ``backend``."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ):
        if world_size < 2 or not 0 <= rank < world_size:
            raise GroupError(f"weight group {name!r}: rank {rank} of world size {world_size} is not valid")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.store = store  # keep the store alive as long as the group (rank 0 serves it)
        start = time.monotonic()
        try:
            self.pg = _make_backend(dist.PrefixStore(name, store), rank, world_size, backend, timeout_s)
        except GroupError:
            raise
        except Exception as exc:  # DistStoreError, gloo connect errors: a peer never came or was unreachable
            waited = time.monotonic() - start
            raise GroupTimeout(
                f"{self}: not every one of the {world_size} ranks joined within {timeout_s:g} s "
                f"(waited {waited:.1f} s): {type(exc).__name__}: {exc}"
            ) from exc
        self.broken: str | None = None

    def __str__(self) -> str:
        return f"weight group {self.name!r} ({self.backend}, rank {self.rank} of {self.world_size})"

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> WeightGroup:
        """Join as ``rank`` through the store of rank 0 (the server side of ``/init_weights_update_group``)."""
        try:
            store = connect_store(master_address, master_port, timeout_s)
        except Exception as exc:
            raise GroupTimeout(
                f"weight group {name!r}: cannot reach its store at {master_address}:{master_port} within "
                f"{timeout_s:g} s: {type(exc).__name__}: {exc}"
            ) from exc
        return cls(store, name, rank, world_size, backend, timeout_s)

    def broadcast(self, tensor: torch.Tensor, what: str = "a tensor") -> None:
        """Broadcast ``tensor`` from rank 0 into every other rank's ``tensor`` (in place), within the timeout."""
        if self.broken:
            raise GroupError(f"{self} is unusable after an earlier failure ({self.broken}): make it again")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        options.timeout = timedelta(seconds=self.timeout_s + MARGIN_S[self.backend])
        try:
            work = self.pg.broadcast([tensor], options)
        except Exception as exc:
            self._fail(f"broadcast of {what} failed to start: {exc}")
            raise GroupError(f"{self}: broadcast of {what} failed to start: {exc}") from exc
        self._wait(work, what)

    def _wait(self, work, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        sleep = 0.00005
        while not work.is_completed():
            if time.monotonic() >= deadline:
                peers = "the receivers" if self.rank == 0 else "rank 0 (the trainer)"
                message = (
                    f"{self}: timed out after {self.timeout_s:g} s waiting for {peers} to broadcast {what} "
                    f"({self.world_size - 1} peer(s) of rank {self.rank})"
                )
                self._fail(f"timeout on {what}")
                raise GroupTimeout(message)
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)
        try:
            work.wait()  # raises the backend's error; on CUDA it also orders the current stream after the op
        except Exception as exc:
            self._fail(f"{what}: {exc}")
            raise GroupError(f"{self}: broadcast of {what} failed: {exc}") from exc

    def _fail(self, why: str) -> None:
        self.broken = why
        if self.backend == "nccl":  # cancel the op left on the NCCL stream, before the watchdog acts on it
            try:
                self.pg.abort()
            except Exception as exc:  # best effort: the group is dropped anyway
                log.warning("%s: abort failed: %s", self, exc)

    def destroy(self) -> None:
        """Leave the group (idempotent).

        A failed group may still have an operation pending; freeing its backend would wait for the backend's
        own timeout while holding the GIL (the whole process stalls), so it is kept, unused, until exit.
        """
        pg, self.pg = getattr(self, "pg", None), None
        failed, self.broken = self.broken, self.broken or "destroyed"
        if pg is None:
            return
        if self.backend == "nccl":
            try:
                pg.abort()  # local: frees the communicator without waiting for the peers
            except Exception as exc:
                log.debug("%s: abort: %s", self, exc)
        if failed:
            _GRAVEYARD.append(pg)
