"""One trainer rank's part of a sharded recover checkpoint, written in the background, with
``torch.distributed.checkpoint`` (DCP).

- One copy in total: each rank writes the shards it holds (FSDP2 DTensors); DCP gives each replicated
  plain tensor (an optimizer ``step``) to one rank.
- Asynchronous: ``AsyncSave.save`` blocks only while the state is copied to CPU memory, into buffers made at
  the first save (pinned with a GPU) and reused by the next ones (DCP's DefaultStager cannot be reused on
  torch 2.11 and allocates afresh each time); a thread of ours then runs ``dcp.save`` on the copy and hashes
  the files it wrote. Not ``dcp.async_save``: it gives no hook, in its writer thread, to hash the files after
  the write. The thread's collectives run on a gloo group of their own, never on the training group.
- Safetensors, no pickles: DCP's HuggingFaceStorageWriter writes each rank's shards with their offsets in
  the safetensors header, and HuggingFaceStorageReader rebuilds the layout from those headers, so a load
  reshards to any number of ranks and reads no ``.metadata`` pickle. Hence tensors only: the caller keeps
  non-tensor state (the optimizer's ``param_groups``, counters) in JSON. Each key has its own buffer, so no two
  staged tensors share memory (which safetensors refuses).
- Files go into ``folder`` directly; the caller lists them in its manifest and renames the folder.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

from areal_hpc.control import sha256_file

# About the bytes of one file a rank writes: the safetensors writer builds a whole file in memory first.
FILE_BYTES = 1 << 30


class AsyncSave:
    """One rank's background writer of sharded checkpoints.

    Every rank constructs it at the same point, after joining the process group: its gloo group is made by
    a collective.
    """

    def __init__(self) -> None:
        self._group = tdist.new_group(backend="gloo") if tdist.is_initialized() else None
        self._buffers: dict[str, torch.Tensor] = {}  # CPU copies (pinned with CUDA), kept for the next save
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, dict] | BaseException | None = None

    def save(self, state: dict, folder: Path) -> None:
        """Stage `state` (a nested dict of tensors / DTensors, e.g. {"actor": {"model": ..., "optimizer":
        ...}} as torch.distributed.checkpoint.state_dict.get_state_dict gives, its non-tensor entries such as
        the optimizer's "param_groups" left out) to CPU memory and return; the bytes are written under
        `folder` by a background thread. A collective: every rank calls it with the same keys. Raises if a
        previous save is still pending (call wait first); TypeError, naming the key, for a non-tensor value.
        """
        if self.pending():
            raise RuntimeError("the previous checkpoint is still pending: call wait() before saving again")
        if self._group is None and tdist.is_initialized():
            raise RuntimeError("this AsyncSave was made before the process group: make it after joining")
        tensors = _tensors(state)
        files = _file_numbers(tensors, tdist.get_world_size(self._group) if self._group else 1)
        staged = self._stage(tensors)
        self._outcome = None
        self._thread = threading.Thread(
            target=self._write, args=(staged, Path(folder), files), name="AsyncSave", daemon=True
        )
        self._thread.start()

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """CPU copies of ``tensors`` (a DTensor keeps its layout around its local shard's copy), into buffers
        allocated at the first save and reused after: a save then costs one device-to-host copy."""
        staged = {}
        for key, tensor in tensors.items():
            local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self._buffers[key] = buffer
            buffer.copy_(local, non_blocking=local.is_cuda)
            if isinstance(tensor, DTensor):
                buffer = DTensor.from_local(
                    buffer, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                    stride=tensor.stride(), run_check=False,
                )  # fmt: skip
            staged[key] = buffer
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are done: training may change the tensors now
        return staged

    def pending(self) -> bool:
        """A save was started and not yet waited for."""
        return self._thread is not None

    def done(self) -> bool:
        """The pending save's writing has finished (or failed); False if none is pending."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> dict[str, dict]:
        """Block until the pending save is written; the files THIS rank wrote, relative to the folder, each
        {"size": int, "sha256": str} (hashed by the background thread right after writing, so nobody re-reads
        the bytes). Re-raises the writer's error. {} when nothing is pending."""
        if self._thread is None:
            return {}
        self._thread.join()
        outcome, self._thread, self._outcome = self._outcome, None, None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome or {}

    def close(self) -> None:
        """Wait for a pending save (its outcome is dropped: call wait to see it) and free the gloo group. A
        writer stuck on a dead peer ends at the group's timeout."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._group is not None:
            tdist.destroy_process_group(self._group)
            self._group = None
        self._buffers = {}

    def _write(self, staged: dict[str, torch.Tensor], folder: Path, files: dict[str, int]) -> None:
        try:
            writer = _Writer(str(folder), fqn_to_index_mapping=files, save_distributed=True)
            dcp.save(staged, storage_writer=writer, process_group=self._group, no_dist=self._group is None)
            self._outcome = {
                name: {"size": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
                for name in writer.written
            }
        except BaseException as exc:  # handed to wait(), which runs on the training thread
            error = RuntimeError(f"writing this rank's checkpoint shards to {folder} failed: {exc}")
            error.__cause__ = exc
            self._outcome = error


def load(state: dict, folder: Path) -> None:
    """Fill `state` (same structure, tensors / DTensors of THIS run's layout, any number of ranks) in place
    from the checkpoint in `folder`: DCP reshards. A collective (on the default process group)."""
    dcp.load(_tensors(state), storage_reader=HuggingFaceStorageReader(str(folder)))


class _Writer(HuggingFaceStorageWriter):
    """DCP's safetensors writer that also keeps the names of the files this rank wrote."""

    written: tuple[str, ...] = ()

    def write_data(self, plan: Any, planner: Any) -> Any:
        results = super().write_data(plan, planner)
        self.written = tuple(sorted({r.storage_data.relative_path for r in results.wait()}))
        return results


def _tensors(state: Mapping, prefix: str = "") -> dict[str, torch.Tensor]:
    """`state` flattened to {"a.b.c": tensor}, DCP's own key names; TypeError for a value that is not one."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_tensors(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            out[name] = value
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
