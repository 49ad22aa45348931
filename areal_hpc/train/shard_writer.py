"""The process that writes a trainer rank's checkpoint shards, and the shared memory it reads them from.

A process, not a thread of the trainer: serialising and hashing tens of GB holds the GIL for long stretches,
and a trainer thread launching kernels waits behind it (measured on one H200, 3B: a training step of 4.0 s
took 5.7 s during a one-thread write and 13.5 s during a four-thread one). Here the writer has its own
interpreter and as many threads as it likes.

- ``Region``: the staged tensors of one rank in one file of /dev/shm, mapped by the trainer (which copies
  into it) and by the writer (which reads it). Each key is its own tensor over its own slice, so no two
  share a storage (safetensors refuses those). The trainer unlinks the file once both have mapped it: a
  crash of either leaves no file behind.
- ``writer_main``: the writer's loop. It maps the regions it is sent, and for each save writes the items the
  trainer planned with DCP's safetensors writer (offsets in the headers: DCP's reader reshards from them)
  and hashes the files. No process group: the trainer planned which rank writes what.
- SIGINT, SIGTERM and SIGUSR2 are ignored: Slurm (a preemption's or a time limit's USR2 notice too) and Ctrl-C
  signal every process of the step, and the trainer's own checkpoint on a notice is written by this process. It ends when the trainer says stop or goes away.
"""

from __future__ import annotations

import math
import mmap
import os
import signal
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from areal_hpc.control import sha256_file

ALIGN = 4096  # each tensor starts on a page: aligned for every dtype and for the copy engines
# (dtype, shape, byte offset) of each key in a region
Layout = dict[str, tuple[torch.dtype, tuple[int, ...], int]]


def layout_of(tensors: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    """Where each tensor goes in a region, and the region's size in bytes."""
    layout, size = {}, 0
    for key, tensor in tensors.items():
        layout[key] = (tensor.dtype, tuple(tensor.shape), size)
        size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN  # rounded up to ALIGN
    return layout, size


class Region:
    """Tensors laid out by `layout` over the file `path` (made with `size` bytes when `create`)."""

    def __init__(self, path: Path, layout: Layout, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.tensors = {key: self._tensor(*where) for key, where in layout.items()}

    def _tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset).view(shape)

    def address(self) -> int:
        """The mapping's first byte (for page-locking it)."""
        return torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()


class _Writer(HuggingFaceStorageWriter):
    """DCP's safetensors writer, files named by this rank (its planner saw one plan: its own), keeping the
    names of the files it wrote."""

    written: tuple[str, ...] = ()

    def __init__(self, path: str, rank: int, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.shard_rank = rank  # not `rank`: DCP sets that to its own (0 without collectives)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        (plan,) = super().prepare_global_plan(plans)
        plan.storage_data["shard_index"] = self.shard_rank + 1  # as DCP numbers the plans of all ranks
        return [plan]

    def write_data(self, plan: Any, planner: Any) -> Any:
        results = super().write_data(plan, planner)
        self.written = tuple(sorted({r.storage_data.relative_path for r in results.wait()}))
        return results


class _Planned(SavePlanner):
    """The write items the trainer planned (with DCP's own local planner, on its DTensors), resolved to
    this process's copies of the shards."""

    def __init__(self, items: list[WriteItem]):
        self.items = items

    def set_up_planner(
        self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.tensors = state_dict

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return all_plans, Metadata(state_dict_metadata={})  # the shards' headers are the metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.tensors[write_item.index.fqn]


def write(tensors: dict[str, torch.Tensor], save: dict) -> dict[str, dict]:
    """Write the items of `save` ({"folder", "items", "files", "rank", "threads"}) with `threads` threads;
    {file: {"size", "sha256"}}."""
    threads = save["threads"]
    folder = Path(save["folder"])
    writer = _Writer(
        str(folder), save["rank"], fqn_to_index_mapping=save["files"], save_distributed=True,
        thread_count=threads,
    )  # fmt: skip
    state = {key: tensors[key] for key in {item.index.fqn for item in save["items"]}}
    dcp.save(state, storage_writer=writer, planner=_Planned(save["items"]), no_dist=True)
    with ThreadPoolExecutor(threads) as pool:
        digests = pool.map(sha256_file, [folder / name for name in writer.written])
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": digest}
        for name, digest in zip(writer.written, digests, strict=True)
    }


def writer_main(conn: Connection) -> None:
    """Serve the trainer's requests on `conn` until it says stop or closes it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # its default action ends the process (exit code -12)
    torch.set_num_threads(1)
    # dcp.save without a process group says it assumes one process: it is told so (no_dist) on purpose
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tensors: dict[str, torch.Tensor] = {}  # views of the regions mapped, which they keep mapped
    while True:
        try:
            request, body = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if request == "stop":
            return
        try:
            if request == "map":
                tensors.update(Region(Path(body["path"]), body["layout"], body["size"], create=False).tensors)
                conn.send(("mapped", None))
            elif request == "save":
                start = time.monotonic()
                files = write(tensors, body)
                conn.send(("written", {"files": files, "seconds": time.monotonic() - start}))
            else:
                raise ValueError(f"unknown request {request!r}")
        except Exception:  # the trainer raises it, with this traceback
            conn.send(("failed", traceback.format_exc()))
