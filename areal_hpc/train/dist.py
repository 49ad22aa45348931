"""torch.distributed for trainer ranks: a process group met through a file, and collectives that are safe to call
alone.

Ranks rendezvous through a file in the run directory (``file://`` init): no address or port has to be agreed on
and it works on shared storage. The file must be fresh for each group (name it per attempt). Every collective
runs under the process group's timeout, so a dead peer ends in an error instead of a hang. The helpers below are
no-ops when torch.distributed is not initialised or the world has one rank, so single-process code needs no
branches.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def local_rank(rank: int = 0) -> int:
    """This process's index on its node: from the launcher's environment, else ``rank`` modulo the GPU count."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    n_gpus = torch.cuda.device_count()
    return rank % n_gpus if n_gpus else 0


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
    init_file: str | Path,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Join the trainer process group through ``init_file``; returns the backend (nccl with CUDA, else gloo).

    ``timeout_s`` bounds the rendezvous and every later collective of the group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank(rank))
    init_file = Path(init_file).resolve()
    init_file.parent.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def init_alone() -> None:
    """A one-rank process group of this process, unless it already joined one (for code that needs a group,
    such as FSDP, run outside a trainer: tests, tools)."""
    if not is_initialized():
        init_distributed(0, 1, Path(tempfile.mkdtemp(prefix="areal-dist-")) / "init")


def destroy() -> None:
    """Leave the process group (no-op when not initialised)."""
    if is_initialized():
        dist.destroy_process_group()


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
