"""The trainer's end of weight publication: trainer rank 0 hosts the group's store, joins as rank 0 and
broadcasts the actor's weights bucket by bucket.

What is sent is the engine's ``hf_weights()`` stream, planned from its ``hf_params()``: HF names
(``model.layers.0.self_attn.q_proj.weight``), in the model's order, cast to the configured dtype. A tied weight
appears under each name the engine gives it (the torch engine's state dict names ``model.embed_tokens.weight``
and ``lm_head.weight`` of a tied Qwen2; a sharded engine each parameter once); a receiver that copies by name
into its own state dict writes into the one shared tensor either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import torch

from areal_hpc.weights.bucket import Stager, TensorMeta, bucket_fields, plan_buckets, tensor_meta
from areal_hpc.weights.group import WeightGroup, host_store

log = logging.getLogger(__name__)


def weight_metas(weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """The metas of ``weights`` as sent (floating tensors in ``dtype`` when given)."""
    return [
        tensor_meta(name, t, dtype if dtype is not None and t.is_floating_point() else None)
        for name, t in weights.items()
    ]


def send_buckets(
    group: WeightGroup,
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    buckets: list[list[TensorMeta]],
    stager: Stager | None = None,
) -> int:
    """Broadcast each bucket of ``weights`` as one flat buffer (staged by ``stager``, made for ``buckets``;
    keep one across publications); returns the bytes sent.

    ``weights`` may be a stream of ``(name, tensor)`` (a sharded engine gathers each as it comes): a bucket is
    sent as soon as its last tensor arrived, so in plan order only one bucket's tensors are held at a time.
    """
    stager = stager or Stager(buckets)
    stream = weights.items() if isinstance(weights, Mapping) else weights
    bucket_of = {m.name: i for i, b in enumerate(buckets) for m in b}
    held: dict[str, torch.Tensor] = {}
    waiting = [len(b) for b in buckets]  # tensors each bucket still waits for: O(1) a tensor, not O(bucket)
    total, next_bucket = 0, 0
    for name, tensor in stream:
        if name in bucket_of:
            waiting[bucket_of[name]] -= name not in held
            held[name] = tensor
        while next_bucket < len(buckets) and waiting[next_bucket] == 0:
            bucket = buckets[next_bucket]
            flat = stager.flat(next_bucket, [held.pop(m.name) for m in bucket])
            what = f"bucket {next_bucket + 1}/{len(buckets)} ({len(bucket)} tensors, {flat.nbytes} bytes)"
            group.broadcast(flat.view(torch.uint8), what)  # SGLang receives a flattened bucket as bytes
            total += flat.nbytes
            next_bucket += 1
    if next_bucket < len(buckets):
        missing = [m.name for b in buckets[next_bucket:] for m in b if m.name not in held]
        raise KeyError(
            f"the model has no weights named {missing[:5]} (of {len(missing)}) that the plan lists"
        )
    return total


class WeightSender:
    """Trainer rank 0's state between the requests of the publisher: the store, the group and the plan."""

    def __init__(self) -> None:
        self.store = None
        self.group: WeightGroup | None = None
        self.buckets: list[list[TensorMeta]] = []
        self.stager: Stager | None = None
        self.name, self.timeout_s = "", 300.0

    def open(self, name: str, timeout_s: float, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve the store of group ``name`` on ``host``, where the servers reach it (dropping any earlier
        group); returns its port."""
        self.close()
        self.name, self.timeout_s = name, timeout_s
        self.store = host_store(host, port, timeout_s)
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
        self.stager = Stager(self.buckets)
        self.group = WeightGroup(self.store, self.name, 0, world_size, backend, self.timeout_s)
        log.info("%s: joined; %d buckets", self.group, len(self.buckets))
        return self.buckets

    def send(self, weights: Mapping[str, torch.Tensor]) -> dict:
        """Broadcast ``weights`` as planned; ``{"bytes", "buckets", "secs"}``."""
        if self.group is None:
            raise RuntimeError("the weight group is not set up (request init_weight_group first)")
        start = time.monotonic()
        with torch.no_grad():
            sent = send_buckets(self.group, weights, self.buckets, self.stager)
        return {"bytes": sent, "buckets": len(self.buckets), "secs": time.monotonic() - start}

    def close(self) -> None:
        """Leave the group and stop serving its store."""
        if self.group is not None:
            self.group.destroy()
        self.group, self.store, self.buckets, self.stager = None, None, [], None


def plan_payload(buckets: list[list[TensorMeta]]) -> list[dict]:
    """The plan as JSON: a ``{"names", "dtypes", "shapes"}`` per bucket."""
    return [bucket_fields(b) for b in buckets]
