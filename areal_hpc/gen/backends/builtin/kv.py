"""KV-cache surgery for continuous batching: select rows, left-pad and join two caches, drop dead columns.

A cache is handled as its per-layer (keys, values) tensors of shape [B, heads, L, head_dim] and rebuilt as a
transformers ``DynamicCache``; only full-attention layers are supported (``check_supported``). Rows are
left-padded: column j of every row is one position of the shared cache, masked out where the row has no token.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def check_supported(config) -> None:
    """Refuse models whose layers are not all full attention (sliding windows would need their own caches)."""
    kinds = set(getattr(config.get_text_config(), "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(
            f"the built-in generation server supports full-attention models only, got {sorted(kinds)}"
        )


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument taking the cache (``cache`` in recent transformers, else ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layers_of(cache: DynamicCache) -> Layers:
    """The cache's per-layer (keys, values)."""
    return [(item[0], item[1]) for item in cache]


def new_cache() -> DynamicCache:
    """An empty cache for a prefill (plain full-attention layers, matching ``check_supported``)."""
    return DynamicCache()


def build(layers: Layers) -> DynamicCache:
    """A DynamicCache holding ``layers``."""
    return DynamicCache(layers)


def select_rows(cache: DynamicCache, index: torch.Tensor) -> DynamicCache:
    """The cache of rows ``index`` (repeats allowed: a prompt prefilled once can serve n samples)."""
    return build([(k[index], v[index]) for k, v in layers_of(cache)])


def drop_columns(cache: DynamicCache, first: int) -> DynamicCache:
    """The cache without its first ``first`` columns (positions every remaining row has masked out)."""
    return build([(k[:, :, first:], v[:, :, first:]) for k, v in layers_of(cache)])


def join(
    cache_a: DynamicCache, mask_a: torch.Tensor, cache_b: DynamicCache, mask_b: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Stack two batches' caches and attention masks [B, L], left-padding the shorter one."""
    length = max(mask_a.shape[1], mask_b.shape[1])

    def pad(t: torch.Tensor, cols: int) -> torch.Tensor:
        return F.pad(t, (0, 0, length - cols, 0)) if cols < length else t

    la, lb = mask_a.shape[1], mask_b.shape[1]
    layers = [
        (torch.cat([pad(ka, la), pad(kb, lb)]), torch.cat([pad(va, la), pad(vb, lb)]))
        for (ka, va), (kb, vb) in zip(layers_of(cache_a), layers_of(cache_b), strict=True)
    ]
    mask = torch.cat([F.pad(mask_a, (length - la, 0)), F.pad(mask_b, (length - lb, 0))])
    return build(layers), mask
