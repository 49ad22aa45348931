"""The trainer's end of weight publication: trainer rank 0 hosts the group's store, joins as rank 0 and
broadcasts the actor's weights bucket by bucket.

What is sent is the engine's ``hf_weights()``, the HF model's state dict: its names (``model.layers.0.self_attn.q_proj.weight``), in
its order, cast to the configured dtype. Tied weights appear under each name the state dict gives them
(``model.embed_tokens.weight`` and ``lm_head.weight`` of a tied Qwen2); a receiver that copies by name into
its own state dict writes the same values into the one shared tensor twice, which is consistent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from areal_hpc.weights.bucket import TensorMeta, bucket_fields, flatten, plan_buckets, tensor_meta, to_dtype
from areal_hpc.weights.group import WeightGroup, host_store

log = logging.getLogger(__name__)


def weight_metas(weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """The metas of ``weights`` as sent (floating tensors in ``dtype`` when given)."""
    return [
        tensor_meta(name, t, dtype if dtype is not None and t.is_floating_point() else None)
        for name, t in weights.items()
    ]


def send_buckets(
    group: WeightGroup, weights: Mapping[str, torch.Tensor], buckets: list[list[TensorMeta]]
) -> int:
    """Broadcast each bucket of ``weights`` as one flat buffer; returns the bytes sent."""
    missing = [m.name for b in buckets for m in b if m.name not in weights]
    if missing:
        raise KeyError(
            f"the model has no weights named {missing[:5]} (of {len(missing)}) that the plan lists"
        )
    total = 0
    for i, bucket in enumerate(buckets):
        flat = flatten([weights[m.name] for m in bucket], to_dtype(bucket[0].dtype))
        group.broadcast(flat, f"bucket {i + 1}/{len(buckets)} ({len(bucket)} tensors, {flat.nbytes} bytes)")
        total += flat.nbytes
    return total


class WeightSender:
    """Trainer rank 0's state between the requests of the publisher: the store, the group and the plan."""

    def __init__(self) -> None:
        self.store = None
        self.group: WeightGroup | None = None
        self.buckets: list[list[TensorMeta]] = []
        self.name, self.timeout_s = "", 300.0

    def open(self, name: str, timeout_s: float, port: int = 0) -> int:
        """Serve the store of group ``name`` (dropping any earlier group); returns its port."""
        self.close()
        self.name, self.timeout_s = name, timeout_s
        self.store = host_store(port, timeout_s)
        return self.store.port

    def join(
        self,
        world_size: int,
        backend: str,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None,
        bucket_bytes: int,
    ) -> list[list[TensorMeta]]:
        """Join as rank 0 (waits for every server rank) and plan the buckets of ``weights``."""
        if self.store is None:
            raise RuntimeError("open the weight group's store first (request weight_group_store)")
        self.buckets = plan_buckets(weight_metas(weights, dtype), bucket_bytes)
        self.group = WeightGroup(self.store, self.name, 0, world_size, backend, self.timeout_s)
        log.info("%s: joined; %d buckets", self.group, len(self.buckets))
        return self.buckets

    def send(self, weights: Mapping[str, torch.Tensor]) -> dict:
        """Broadcast ``weights`` as planned; ``{"bytes", "buckets", "secs"}``."""
        if self.group is None:
            raise RuntimeError("the weight group is not set up (request init_weight_group first)")
        start = time.monotonic()
        with torch.no_grad():
            sent = send_buckets(self.group, weights, self.buckets)
        return {"bytes": sent, "buckets": len(self.buckets), "secs": time.monotonic() - start}

    def close(self) -> None:
        """Leave the group and stop serving its store."""
        if self.group is not None:
            self.group.destroy()
        self.group, self.store, self.buckets = None, None, []


def plan_payload(buckets: list[list[TensorMeta]]) -> list[dict]:
    """The plan as JSON: a ``{"names", "dtypes", "shapes"}`` per bucket."""
    return [bucket_fields(b) for b in buckets]
