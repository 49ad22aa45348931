"""Buckets of named tensors for a broadcast: plan, flatten, unflatten (pure functions).

A bucket is a list of ``TensorMeta`` of one dtype, at most ``bucket_bytes`` long (a tensor larger than that
gets a bucket of its own). Its tensors travel as ONE contiguous 1-D buffer: their flattened values one after
the other, in bucket order, which is the layout SGLang's ``FlattenedTensorBucket`` gives (the receiver of an
``/update_weights_from_distributed`` request with ``load_format: "flattened_bucket"``). A bucket's metadata is
what that request carries: ``{"names": [...], "dtypes": ["bfloat16", ...], "shapes": [[...], ...]}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")


class FieldError(ValueError):
    """A bad field of a weight-update request; ``field`` names it (``names``, ``dtypes`` or ``shapes``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor: its HF name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * to_dtype(self.dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of SGLang's requests)."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; ValueError for anything else."""
    short = str(name).removeprefix("torch.")
    if short not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; one of {', '.join(DTYPES)}")
    return getattr(torch, short)


def tensor_meta(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorMeta:
    """The meta of ``tensor`` as sent (in ``dtype`` when given, else its own)."""
    return TensorMeta(name, dtype_name(dtype or tensor.dtype), tuple(tensor.shape))


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group ``metas`` into buckets of one dtype and at most ``bucket_bytes`` each.

    Tensors keep their order within a dtype; buckets are ordered by their first tensor. A tensor of more
    than ``bucket_bytes`` gets a bucket of its own. Names must be unique.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    done: list[list[TensorMeta]] = []
    open_: dict[str, list[TensorMeta]] = {}  # the bucket being filled, per dtype
    for meta in metas:
        bucket = open_.get(meta.dtype)
        if bucket and sum(m.nbytes for m in bucket) + meta.nbytes > bucket_bytes:
            done.append(bucket)
            bucket = None
        if not bucket:
            bucket = open_[meta.dtype] = []
        bucket.append(meta)
    done += open_.values()
    first = {name: i for i, name in enumerate(names)}
    return sorted(done, key=lambda b: first[b[0].name])


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One contiguous 1-D buffer holding ``tensors`` one after the other (cast to ``dtype`` when given)."""
    if not tensors:
        raise ValueError("cannot flatten an empty bucket")
    if dtype is None and len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"a bucket holds one dtype: {sorted({dtype_name(t.dtype) for t in tensors})}")
    dtype = dtype or tensors[0].dtype
    # One copy per tensor, straight into place (no reshaped copy of a strided view, no cast copy, no cat), all
    # of them in one foreach call: a bucket of hundreds of small tensors costs no Python loop of copies.
    numels = [t.numel() for t in tensors]
    out = torch.empty(sum(numels), dtype=dtype, device=tensors[0].device)
    places = [part.view(t.shape) for part, t in zip(out.split(numels), tensors, strict=True)]
    torch._foreach_copy_(places, [t.detach() for t in tensors])
    return out


class Stager:
    """Flattens the buckets of one plan for sending, as ``flatten`` does, into one buffer per dtype and device as
    long as the largest bucket, reused by every bucket of every publication, with each bucket's places in it
    made once: a bucket costs one foreach copy per dtype of its tensors (no allocation, no view per tensor;
    the Python work per tensor, not the copy, was most of a publication's gathering and bucketing). A bucket of one contiguous tensor in
    its dtype is sent as it is. A staged buffer holds its bucket until the next one is staged."""

    def __init__(self, buckets: Sequence[Sequence[TensorMeta]]):
        self.buckets = buckets
        self._places: dict[int, list[torch.Tensor]] = {}
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def flat(self, index: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Bucket ``index`` of the plan holding ``tensors`` (its tensors, in bucket order), flat."""
        bucket = self.buckets[index]
        dtype = to_dtype(bucket[0].dtype)
        if len(tensors) == 1 and tensors[0].dtype == dtype and tensors[0].is_contiguous():
            return tensors[0].detach().view(-1)
        device = tensors[0].device
        places = self._places.get(index)
        if places is None or places[0].device != device:
            numels = [m.numel for m in bucket]
            parts = self._buffer(bucket[0].dtype, device)[: sum(numels)].split(numels)
            places = self._places[index] = [p.view(m.shape) for p, m in zip(parts, bucket, strict=True)]
        by_dtype: dict[
            torch.dtype, tuple[list, list]
        ] = {}  # a foreach copy of mixed dtypes copies one by one
        for place, tensor in zip(places, tensors, strict=True):
            dst, src = by_dtype.setdefault(tensor.dtype, ([], []))
            dst.append(place)
            src.append(tensor)
        with torch.no_grad():
            for dst, src in by_dtype.values():
                torch._foreach_copy_(dst, src)
        return self._buffers[bucket[0].dtype, device][: sum(p.numel() for p in places)]

    def _buffer(self, dtype: str, device: torch.device) -> torch.Tensor:
        if (dtype, device) not in self._buffers:
            longest = max(sum(m.numel for m in b) for b in self.buckets if b[0].dtype == dtype)
            self._buffers[dtype, device] = torch.empty(longest, dtype=to_dtype(dtype), device=device)
        return self._buffers[dtype, device]


def empty_buffer(bucket: Sequence[TensorMeta], device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised buffer of the size and dtype of ``bucket``, to receive it into."""
    dtypes = {m.dtype for m in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a bucket holds one dtype, this one has {sorted(dtypes)}")
    return torch.empty(sum(m.numel for m in bucket), dtype=to_dtype(dtypes.pop()), device=device)


def unflatten(flat: torch.Tensor, bucket: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``flat`` for each meta of ``bucket``, in order (no copy)."""
    total = sum(m.numel for m in bucket)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"buffer of shape {tuple(flat.shape)} does not hold the bucket's {total} elements")
    out, offset = [], 0
    for meta in bucket:
        if dtype_name(flat.dtype) != meta.dtype:
            raise ValueError(f"{meta.name}: dtype {meta.dtype}, the buffer is {dtype_name(flat.dtype)}")
        out.append((meta.name, flat[offset : offset + meta.numel].view(meta.shape)))
        offset += meta.numel
    return out


def bucket_fields(bucket: Sequence[TensorMeta]) -> dict[str, list]:
    """The request fields of a bucket: ``{"names", "dtypes", "shapes"}`` (JSON lists)."""
    return {
        "names": [m.name for m in bucket],
        "dtypes": [m.dtype for m in bucket],
        "shapes": [list(m.shape) for m in bucket],
    }


def metas_from_fields(names: Any, dtypes: Any, shapes: Any) -> list[TensorMeta]:
    """Check the request fields and make the metas; FieldError names the bad field (and index)."""
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list):
            raise FieldError(field, f"must be a list, got {type(value).__name__}")
    if not len(names) == len(dtypes) == len(shapes):
        raise FieldError("names", f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    metas = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise FieldError("names", f"[{i}] must be a non-empty string, got {name!r}")
        try:
            short = dtype_name(to_dtype(dtype))
        except ValueError as exc:
            raise FieldError("dtypes", f"[{i}] {exc}") from None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FieldError("shapes", f"[{i}] must be a list of sizes >= 0, got {shape!r}")
        metas.append(TensorMeta(name, short, tuple(shape)))
    if len({m.name for m in metas}) != len(metas):
        raise FieldError("names", "a name repeats")
    return metas
