"""The weight group: a torch.distributed process group of its own between the publishing trainer rank (rank 0)
and every generation server rank, made the way SGLang makes it (``init_custom_process_group``), so that our
trainer meets a real SGLang server and our built-in server meets AReaL's trainer.

- A server rank joins through torch's ``rendezvous("tcp://ADDR:PORT", rank, world_size)``; trainer rank 0 serves
  that TCPStore (``host_store``: on the address the servers are given alone, any free port).
- Both sides wrap the store in ``PrefixStore(group_name)`` and make the group with torch's
  ``_new_process_group_helper`` (no global ranks), which adds its own prefixes (the group name, the device).
- Ranks: 0 is the trainer; a server's TP ranks are ``rank_offset + tp_rank``; world = 1 + every TP rank of every
  server (``server_ranks``).

It needs no default process group and does not touch the trainer's. Only broadcasts from rank 0 are used.
Every wait is bounded: joining by the group's timeout (ours, not SGLang's 30 minutes), each broadcast by
polling its work object against a deadline. A timeout raises ``GroupTimeout`` naming the group, its size and
the seconds; after any failure the group is unusable (its peers may be mid-broadcast) and must be made again.

gloo picks its network interface from the host name; set ``GLOO_SOCKET_IFNAME`` where that is wrong.
gloo's group is made when every rank has joined; NCCL's communicator only at the first broadcast.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# The backend's own op timeout is ours plus this: our message surfaces first. Freeing a gloo group with an op
# pending waits for gloo's timeout (keep it short); NCCL's watchdog must not act before we abort the op.
MARGIN_S = {"gloo": 2.0, "nccl": 30.0}
# Our own timeouts bound every wait of these groups: no NCCL heartbeat monitor (it would kill the process).
# torch 2.11 still runs its thread for dump checks: it logs a warning when rank 0's store goes away first.
NCCL_ENV = {"TORCH_NCCL_ENABLE_MONITORING": "0"}
POLL_S = 0.0002  # how late a broadcast's end is seen, at most, in its first 100 ms
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


def host_store(host: str, port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore served by this process on ``host`` alone (the address its peers are given; a name: its first
    address), at ``port`` (0: any free port); ``store.port`` is the port.

    torch's server ignores ``host_name`` and listens on every interface (``::``); handed a socket already bound
    (``master_listen_fd``, libuv backend), it listens on that socket only. A node name that resolves to loopback
    here (Debian's /etc/hosts maps it to 127.0.1.1) is another address for its peers: then, with a warning, on
    every interface.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    resolved = address[0]  # where the store's own client reaches it
    if ipaddress.ip_address(address[0]).is_loopback and not _loopback_name(host):
        why = "%s resolves to %s here, which its peers cannot reach: the store listens on every interface"
        log.warning(why, host, address[0])
        address = ("::", *address[1:]) if family == socket.AF_INET6 else ("0.0.0.0", address[1])
    with socket.socket(family, kind, proto) as sock:  # closed if the bind fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own: a port in TIME_WAIT
        sock.bind(address)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns it from here: it closes it when freed
    return dist.TCPStore(
        resolved, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
        master_listen_fd=fd, use_libuv=True,
    )  # fmt: skip


def _loopback_name(host: str) -> bool:
    """`host` names this machine's loopback on purpose: localhost, or a loopback address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    """The server side: torch's rendezvous at ``tcp://master_address:master_port``, as SGLang joins."""
    host = f"[{master_address}]" if ":" in master_address else master_address  # an IPv6 address
    url = f"tcp://{host}:{master_port}"
    store, _, _ = next(dist.rendezvous(url, rank, world_size, timeout=timedelta(seconds=timeout_s)))
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def server_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """The rank_offset of each server of TP sizes ``tp_sizes``, and the world size (rank 0: the trainer)."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return offsets, 1 + sum(tp_sizes)


def _new_group(store: dist.Store, name: str, rank: int, world_size: int, backend: str, timeout_s: float):
    """The process group over ``PrefixStore(name, store)``, made by torch's group helper as SGLang makes it."""
    if backend not in BACKENDS:
        raise GroupError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise GroupError("backend nccl needs CUDA and a torch built with NCCL; use gloo on CPU")
    # The backend's own op timeout is ours plus a margin: our message surfaces first.
    timeout = timedelta(seconds=timeout_s + MARGIN_S[backend])
    options = None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream, options._timeout = False, timeout
    # No global ranks: torch makes it as a group of its own. (Were this process's default group bound to a
    # device, torch would split the new NCCL group from it; the trainers' is not bound.)
    with _env(NCCL_ENV if backend == "nccl" else {}):  # read when the group is made
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), dist.PrefixStore(name, store), group_name=name,
            backend_options=options, timeout=timeout,
        )  # fmt: skip
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # as SGLang registers its group
    return pg


def _forget(pg) -> None:
    """Drop a group from torch's registry, so that its name can be used again; the object itself stays."""
    for table in (c10d._world.pg_names, c10d._world.pg_map, c10d._world.pg_group_ranks):
        table.pop(pg, None)


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
            self.pg = _new_group(store, name, rank, world_size, backend, timeout_s)
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
            store = connect_store(master_address, master_port, rank, world_size, timeout_s)
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
        start = time.monotonic()
        deadline, sleep = start + self.timeout_s, 0.00005
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
            # A bucket takes milliseconds, and the next waits on it: see it within POLL_S; a wait that goes on
            # (a slow or lost peer) is polled less often.
            sleep = min(sleep * 2, POLL_S if time.monotonic() - start < 0.1 else 0.005)
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
        _forget(pg)
        if failed:
            _GRAVEYARD.append(pg)
