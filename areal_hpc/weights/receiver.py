"""The server's end of weight publication: join weight groups and receive named tensors from rank 0.

``ReceiverGroups`` is the state behind the built-in server's ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group``. A request's tensors arrive as SGLang
receives them: with ``load_format: "flattened_bucket"`` as ONE flat buffer (the bucket's tensors one after the
other, one dtype), otherwise as one broadcast per tensor in request order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import torch

from areal_hpc.weights.bucket import TensorMeta, empty_buffer, to_dtype, unflatten
from areal_hpc.weights.group import BACKENDS, GroupError, WeightGroup

log = logging.getLogger(__name__)

FLATTENED = "flattened_bucket"  # SGLang's load_format of one flat buffer per request


def receive_bucket(
    group: WeightGroup, bucket: Sequence[TensorMeta], device: torch.device | str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast as a flat buffer; ``(name, tensor)`` views into it."""
    flat = empty_buffer(bucket, device)
    group.broadcast(flat.view(torch.uint8), f"a bucket of {len(bucket)} tensors ({flat.nbytes} bytes)")
    return unflatten(flat, bucket)


def receive_each(
    group: WeightGroup, metas: Sequence[TensorMeta], device: torch.device | str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """Receive one broadcast per tensor, in order (SGLang's default load_format)."""
    out = []
    for meta in metas:
        tensor = torch.empty(meta.shape, dtype=to_dtype(meta.dtype), device=device)
        group.broadcast(tensor, f"tensor {meta.name}")
        out.append((meta.name, tensor))
    return out


def _device_context(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class ReceiverGroups:
    """The weight groups a server has joined, by name; tensors are received onto ``device``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()

    def init(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> WeightGroup:
        """Join ``group_name`` as ``rank`` (replacing a group of that name); blocks until every rank joined."""
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.destroy(group_name)
        with _device_context(self.device):
            group = WeightGroup.join(
                master_address, master_port, rank, world_size, group_name, backend, timeout_s
            )
        with self._lock:
            self.groups[group_name] = group
        log.info("joined %s", group)
        return group

    def get(self, group_name: str) -> WeightGroup:
        with self._lock:
            group = self.groups.get(group_name)
        if group is None:
            known = ", ".join(sorted(self.groups)) or "none"
            raise LookupError(
                f"no weight update group {group_name!r} on this server (joined: {known}): "
                "call /init_weights_update_group first"
            )
        return group

    def receive(
        self, group_name: str, metas: Sequence[TensorMeta], flattened: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive ``metas`` from rank 0 of ``group_name``; a failed group is destroyed (init it again)."""
        group = self.get(group_name)
        try:
            with _device_context(self.device):
                if flattened:
                    return receive_bucket(group, metas, self.device)
                return receive_each(group, metas, self.device)
        except GroupError:
            self.destroy(group_name)
            raise

    def destroy(self, group_name: str) -> bool:
        """Leave ``group_name``; False if this server had no such group."""
        with self._lock:
            group = self.groups.pop(group_name, None)
        if group is None:
            return False
        group.destroy()
        return True
