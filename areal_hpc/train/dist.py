"""torch.distributed for trainer ranks: a process group met through the run directory, and collectives that are
safe to call alone.

Rank 0 serves the group's TCPStore on the address its peers reach it at and writes that address to a file of the
run directory (written once, tmp + rename); the other ranks wait for the file and connect. No file lock is
taken: a ``file://`` rendezvous (torch's FileStore) needs flock, which Lustre without flock refuses (ENOSYS). The
file names its attempt, so that an earlier attempt's address is never used. Every collective runs under the
process group's timeout, so a dead peer ends in an error instead of a hang. The helpers below are no-ops when
torch.distributed is not initialised or the world has one rank, so single-process code needs no branches.
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_hpc.control import fsio, poll_until
from areal_hpc.weights import host_store

DEFAULT_TIMEOUT_S = 600.0
MEETING_POLL_S = 0.1  # the longest sleep between two reads of the meeting file (shared storage)

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_RELEASES: list[Callable[[], None]] = []  # see on_release
_EXIT_HOOKED = False  # whether _release_at_exit is registered


def local_rank(rank: int = 0) -> int:
    """This process's index on its node: from the launcher's environment, else ``rank``."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return rank


def device_index(local: int, visible: int) -> int:
    """The CUDA device of the process of node index ``local`` that sees ``visible`` GPUs.

    Slurm may bind GPUs per task (``--gpus-per-task``, ``--gpu-bind``): a task then sees only its own, from
    device 0, whatever its index on the node.
    """
    return local % visible if visible else 0


def default_device() -> torch.device:
    """The current CUDA device when there is one (set by ``init_distributed``), else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def init_distributed(
    rank: int,
    world_size: int,
    meeting: str | Path,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: str = "127.0.0.1",
    attempt: int = 0,
) -> str:
    """Join the trainer process group of ``attempt``; returns the backend (nccl with CUDA, else gloo).

    Rank 0 serves the group's store on ``host`` (the address the other ranks reach it at) and writes where to
    the file ``meeting``; the others read it there. ``timeout_s`` bounds that wait, the rendezvous and every
    later collective of the group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    meeting = Path(meeting)
    store = _serve(meeting, host, attempt, timeout_s) if rank == 0 else _reach(meeting, attempt, timeout_s)
    return _join(store, rank, world_size, backend, timeout_s)


def _serve(meeting: Path, host: str, attempt: int, timeout_s: float) -> dist.TCPStore:
    store = host_store(host, 0, timeout_s)
    fsio.write_json(meeting, {"host": host, "port": store.port, "attempt": attempt})
    return store


def _reach(meeting: Path, attempt: int, timeout_s: float) -> dist.TCPStore:
    def written() -> dict | None:
        point = fsio.read_json(meeting)
        return point if point and point.get("attempt") == attempt else None

    what = f"trainer rank 0 to write the process group's address of attempt {attempt} to {meeting}"
    point = poll_until(written, timeout_s, what, max_sleep=MEETING_POLL_S)
    return dist.TCPStore(point["host"], point["port"], None, False, timedelta(seconds=timeout_s))


def _join(store: dist.Store, rank: int, world_size: int, backend: str | None, timeout_s: float) -> str:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device_index(local_rank(rank), torch.cuda.device_count()))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:  # once: the groups a rank still held at destroy (its models) are gone by exit
        atexit.register(_release_at_exit)
        _EXIT_HOOKED = True
    return backend


def init_alone() -> None:
    """A one-rank process group of this process, unless it already joined one (for code that needs a group,
    such as FSDP, run outside a trainer: tests, tools)."""
    if not is_initialized():
        _join(dist.HashStore(), 0, 1, None, DEFAULT_TIMEOUT_S)


def destroy() -> None:
    """Leave the process group and free it and its subgroups, so that their threads end now and not while the
    interpreter shuts down (no-op when not initialised). A group the caller still holds (through a model) is
    freed at exit instead, before the interpreter shuts down.

    torch's destroy_process_group stops no thread of a gloo group: its workers (and rank 0's store server) end
    only in the group's destructor, once nothing references the group, and DTensor's caches keep every
    DeviceMesh an FSDP2 model used, and so its groups, for good. A worker that frees a completed collective late
    (kept off a busy CPU) while the interpreter shuts down must take the GIL to free a tensor Python dropped, is
    ended there by pthread_exit inside a noexcept destructor, and std::terminate aborts the rank ("terminate
    called without an active exception").
    """
    if not is_initialized():
        return
    dist.destroy_process_group()
    _free_groups()


def on_release(release: Callable[[], None]) -> None:
    """Have ``release`` run whenever the groups are freed (``destroy``, and at exit): for code that keeps groups
    where the caller cannot drop them, such as a library's globals (Megatron's parallel_state)."""
    if release not in _RELEASES:
        _RELEASES.append(release)


def _release_at_exit() -> None:
    """atexit: destroy the group if the process did not, and free the groups whose holders are gone by now;
    atexit handlers run while the interpreter is whole."""
    destroy()
    _free_groups()


def _free_groups() -> None:
    """Drop the references to process groups kept beyond the caller's objects, then collect: each group left
    unreferenced is freed, its destructor joining its threads (with the GIL released, so that a worker can
    still free what it holds)."""
    from torch.distributed.device_mesh import DeviceMesh

    for release in _RELEASES:
        release()
    # type(), not isinstance: DeviceMesh's metaclass inspects the instance, and these are arbitrary objects
    for mesh in [obj for obj in gc.get_objects() if issubclass(type(obj), DeviceMesh)]:
        vars(mesh).get("_pg_registry", {}).clear()  # name -> group; unusable once the groups are destroyed
    gc.collect()  # an FSDP2 model dropped by the caller is cycles, which hold the group too


def is_initialized() -> bool:
    """Whether this process has joined a process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank, 0 when not initialised."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks, 1 when not initialised."""
    return dist.get_world_size() if is_initialized() else 1


def _active(group=None) -> bool:
    return is_initialized() and dist.get_world_size(group) > 1


def _comm_device(tensor: torch.Tensor) -> torch.device:
    # NCCL only moves CUDA tensors; gloo takes CPU tensors (and copies CUDA ones itself).
    if dist.get_backend() == "nccl":
        return default_device()
    return tensor.device


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The elementwise reduction (``sum``, ``min`` or ``max``) of ``tensor`` over the ranks of ``group`` (None:
    all ranks), as a new tensor.

    Every rank must call it with a tensor of the same shape and dtype.
    """
    out = tensor.detach().clone()
    if not _active(group):
        return out
    comm = out.to(_comm_device(out))
    dist.all_reduce(comm, op=_OPS[op], group=group)
    return comm.to(tensor.device)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group`` (None: all), as a new tensor (a copy when alone)."""
    return all_reduce(tensor, "sum", group)


def all_reduce_(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over all ranks in place (for gradient buffers)."""
    if not _active():
        return
    device = _comm_device(tensor)
    if device == tensor.device:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    else:
        tensor.copy_(all_reduce_sum(tensor))


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """The picklable ``obj`` of every rank of ``group`` (None: all), in rank order (``[obj]`` when alone)."""
    if not _active(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier() -> None:
    """Wait until every rank gets here (no-op when alone)."""
    if _active():
        dist.barrier()
