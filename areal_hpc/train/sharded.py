"""One trainer rank's part of a sharded recover checkpoint, written in the background, with
``torch.distributed.checkpoint`` (DCP).

- One copy in total: each rank writes the shards it holds (FSDP2 DTensors, and a ``RankLocal``'s tensors:
  names of its own, such as a Megatron rank's); a replicated plain tensor (an optimizer ``step``) is written by
  rank 0 alone.
- Asynchronous: ``AsyncSave.save`` blocks only while the state is copied into CPU buffers made once
  (``reserve``, or the first save) and reused by every save after: a save costs one device-to-host copy
  (0.85 s for a 3B model's 37 GB on one H200; DCP's DefaultStager allocates afresh each time: 20 s). A
  writer process of this rank (``train.shard_writer``) then writes and hashes the files, while training
  goes on. Not ``dcp.async_save``: it gives no hook to hash the files after the write.
- The buffers are one file of /dev/shm per ``reserve``, mapped by both processes; with a GPU the mapping is
  page-locked (``cudaHostRegister``) at its exact size (torch's pinned allocator rounds each block up to a
  power of two: up to twice the host memory).
- Safetensors, no pickles: DCP's HuggingFaceStorageWriter writes each rank's shards with their offsets in
  the safetensors header, and HuggingFaceStorageReader rebuilds the layout from those headers, so a load
  reshards to any number of ranks and reads no ``.metadata`` pickle. Hence tensors only: the caller keeps
  non-tensor state (the optimizer's ``param_groups``, counters) in JSON.
- Files go into ``folder`` directly; the caller lists them in its manifest and renames the folder.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from areal_hpc.train.shard_writer import Region, layout_of, writer_main

# About the bytes of one file a rank writes: the safetensors writer builds a whole file in memory first.
FILE_BYTES = 1 << 30
# Files the writer process writes (and then hashes) at once.
WRITE_THREADS = 4
SHM = Path("/dev/shm")


class AsyncSave:
    """One rank's background writer of sharded checkpoints: a writer process, started here, and the CPU
    buffers it shares with this process. Not a collective: each rank writes its own files."""

    def __init__(self) -> None:
        self._rank = tdist.get_rank() if tdist.is_initialized() else 0
        self._world = tdist.get_world_size() if tdist.is_initialized() else 1
        context = mp.get_context("spawn")  # no fork of a process that holds CUDA and NCCL state
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=writer_main, args=(theirs,), name="checkpoint-writer", daemon=True
        )
        self._process.start()
        theirs.close()
        self._buffers: dict[str, torch.Tensor] = {}  # views of the shared regions, which they keep mapped
        self._pinned: list[int] = []  # addresses of page-locked regions, unlocked by close
        self._folder: Path | None = None  # of the pending save
        self.write_seconds = 0.0  # how long the writer took for the last save waited for

    def reserve(self, state: dict) -> None:
        """Make the CPU buffers of `state` (as `save` takes it) now, so that no save pays for them; with a
        GPU they are page-locked, which touches every page (seconds for tens of GB)."""
        self._reserve(_locals(self._split(state)[1]))

    def _split(self, state: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every tensor of `state` by key, and those this rank writes: its shards, its ``RankLocal`` tensors
        and, on rank 0, the replicated plain ones."""
        owned: set[str] = set()
        tensors = _tensors(state, owned=owned)
        mine = {k: t for k, t in tensors.items() if isinstance(t, DTensor) or k in owned or self._rank == 0}
        return tensors, mine

    def _reserve(self, locals_: dict[str, torch.Tensor]) -> None:
        self._map({k: t for k, t in locals_.items() if not self._fits(k, t)})

    def _fits(self, key: str, local: torch.Tensor) -> bool:
        buffer = self._buffers.get(key)
        return buffer is not None and buffer.shape == local.shape and buffer.dtype == local.dtype

    def _map(self, locals_: dict[str, torch.Tensor]) -> None:
        """One region for `locals_` (local shards), mapped here and by the writer, then unlinked."""
        if not locals_:
            return
        layout, size = layout_of(locals_)
        folder = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
        stat = os.statvfs(folder)
        free = stat.f_bavail * stat.f_frsize
        if size > free:
            raise RuntimeError(
                f"a recover checkpoint stages {size / 1e9:.1f} GB of this rank's state in {folder}, which has "
                f"{free / 1e9:.1f} GB free: give the job more shared memory, or use more trainer ranks"
            )
        path = folder / f"areal-checkpoint-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        region = Region(path, layout, size, create=True)
        try:
            self._send("map", {"path": str(path), "layout": layout, "size": size})
            self._reply("mapped")
        finally:
            path.unlink()  # both processes hold the mapping: the memory lives as long as they do
        if torch.cuda.is_available() and any(t.is_cuda for t in locals_.values()):
            address = region.address()
            _check_cuda(torch.cuda.cudart().cudaHostRegister(address, size, 0))
            self._pinned.append(address)
        self._buffers.update(region.tensors)

    def save(self, state: dict, folder: Path) -> None:
        """Stage `state` (a nested dict of tensors / DTensors, e.g. {"actor": {"model": ..., "optimizer":
        ...}} as torch.distributed.checkpoint.state_dict.get_state_dict gives, its non-tensor entries such as
        the optimizer's "param_groups" left out) to CPU memory and return; the writer process writes this
        rank's files under `folder`. Every rank calls it with the same keys. Raises if a previous save is
        still pending (call wait first); TypeError, naming the key, for a non-tensor value.
        """
        if self.pending():
            raise RuntimeError("the previous checkpoint is still pending: call wait() before saving again")
        tensors, mine = self._split(state)
        items = create_default_local_save_plan(mine, self._rank == 0).items  # this rank's shards
        locals_ = _locals(mine)  # staged: what this rank writes, no replica it leaves to rank 0
        self._reserve(locals_)
        self._stage(locals_)
        body = {"folder": str(folder), "items": items, "files": _file_numbers(tensors, self._world)}
        self._send("save", {**body, "rank": self._rank, "threads": WRITE_THREADS})
        self._folder = Path(folder)

    def _stage(self, locals_: dict[str, torch.Tensor]) -> None:
        """Copy each local shard into its buffer."""
        for key, local in locals_.items():
            self._buffers[key].copy_(local, non_blocking=local.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are done: training may change the tensors now

    def pending(self) -> bool:
        """A save was started and not yet waited for."""
        return self._folder is not None

    def done(self) -> bool:
        """The pending save's writing has finished (or failed); False if none is pending."""
        return self.pending() and self._conn.poll()

    def wait(self) -> dict[str, dict]:
        """Block until the pending save is written; the files THIS rank wrote, relative to the folder, each
        {"size": int, "sha256": str} (hashed by the writer right after writing, so nobody re-reads the
        bytes). Raises the writer's error. {} when nothing is pending."""
        if self._folder is None:
            return {}
        folder, self._folder = self._folder, None
        try:
            written = self._reply("written")
        except RuntimeError as exc:
            raise RuntimeError(f"writing this rank's checkpoint shards to {folder} failed: {exc}") from None
        self.write_seconds = written["seconds"]
        return written["files"]

    def close(self) -> None:
        """Wait for a pending save (its outcome is dropped: call wait to see it), stop the writer process
        and free the buffers."""
        if self._process.is_alive():
            with contextlib.suppress(RuntimeError):
                self.wait()
            with contextlib.suppress(RuntimeError):
                self._send("stop", None)
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()
        for address in self._pinned:
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(address))
        self._pinned, self._buffers = [], {}

    def _send(self, request: str, body: Any) -> None:
        try:
            self._conn.send((request, body))
        except OSError:  # a broken pipe: nobody reads at the other end
            raise self._died() from None

    def _reply(self, expected: str) -> Any:
        try:
            answer, body = self._conn.recv()
        except EOFError:
            raise self._died() from None
        if answer == "failed":
            raise RuntimeError(body)
        assert answer == expected, (answer, expected)
        return body

    def _died(self) -> RuntimeError:
        self._process.join(timeout=5)
        return RuntimeError(
            f"the checkpoint writer process {self._process.pid} died (exit code {self._process.exitcode})"
        )


def load(state: dict, folder: Path) -> None:
    """Fill `state` (same structure, tensors / DTensors of THIS run's layout, any number of ranks) in place
    from the checkpoint in `folder`: DCP reshards. A collective (on the default process group)."""
    dcp.load(_tensors(state), storage_reader=HuggingFaceStorageReader(str(folder)))


def _locals(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's shard on this rank (a plain tensor is its own)."""
    return {k: (t.to_local() if isinstance(t, DTensor) else t).detach() for k, t in tensors.items()}


def _check_cuda(error: Any) -> None:
    if int(error) != 0:
        raise RuntimeError(f"page-locking a checkpoint buffer failed: CUDA error {int(error)}")


class RankLocal(dict):
    """Tensors this rank alone holds, under names no other rank uses (a Megatron rank's shards): this rank
    writes them, where a plain tensor elsewhere is a replica that rank 0 alone writes."""


def _tensors(
    state: Mapping, prefix: str = "", owned: set[str] | None = None, local: bool = False
) -> dict[str, torch.Tensor]:
    """`state` flattened to {"a.b.c": tensor}, DCP's own key names; TypeError for a value that is not one.
    The keys of tensors inside a ``RankLocal`` are added to ``owned``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_tensors(value, f"{name}.", owned, local or isinstance(value, RankLocal)))
        elif isinstance(value, torch.Tensor):
            out[name] = value
            if local and owned is not None:
                owned.add(name)
        else:
            raise TypeError(
                f"checkpoint entry {name!r} is a {type(value).__name__}, not a tensor: a sharded checkpoint "
                "holds tensors only (keep the rest, e.g. the optimizer's param_groups, in JSON)"
            )
    return out


def _file_numbers(tensors: dict[str, torch.Tensor], world_size: int) -> dict[str, int]:
    """Key -> number of its file (1, 2, ...): consecutive keys in files of about FILE_BYTES per rank.

    From global sizes, so every rank computes the same numbers."""
    numbers, total = {}, 0
    for key, tensor in tensors.items():
        numbers[key] = 1 + total // (FILE_BYTES * world_size)
        total += tensor.numel() * tensor.element_size()
    return numbers
