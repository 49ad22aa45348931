"""Packed micro-batches without padding: the sequences of a micro-batch laid end to end as one row, attention
confined to each sequence.

The HF model runs on ``input_ids [1, T]`` with ``position_ids`` restarting at 0 for every sequence (the rotary
embedding of each token is that of its sequence alone) and the attention function registered here under
``ATTENTION``, which reads the sequences' bounds from ``cu_seq_lens_q``/``max_length_q`` (the names
transformers passes through to attention, as for FlashAttention's varlen kernels):

- on CUDA in bf16 or fp16, PyTorch's varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``): no
  padding, no mask;
- otherwise (the CPU tests, float32), causal SDPA over each sequence in turn: exact, and fast enough for tiny
  models.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from areal_hpc.train import ulysses
from areal_hpc.train.ulysses import ContextGroup

ATTENTION = "areal_packed"


def packed_kwargs(cu_seqlens: torch.Tensor, context: ContextGroup | None = None) -> dict:
    """The model inputs besides ``input_ids [1, T]`` that make it run a packed micro-batch; with a ``context``
    group, its rank's slice of them (``input_ids`` too must be the slice)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    positions = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts
    cu32 = cu_seqlens.to(torch.int32)
    packed = {
        "position_ids": positions[None],
        "cu_seq_lens_q": cu32,
        "cu_seq_lens_k": cu32,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }
    if context is None:
        return packed
    start, end = context.bounds(len(positions))
    return {**packed, "position_ids": positions[None, start:end], "context_group": context}


@functools.cache
def _varlen_attn() -> tuple[Callable, frozenset[str]]:
    """torch's varlen kernel and the names of its parameters (they differ between torch versions)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(q, k, v, cu, max_len, scale):
    varlen_attn, params = _varlen_attn()  # looked up once, not in every layer of every micro-batch
    kwargs = {"scale": scale}
    if "window_size" in params:  # torch >= 2.12 spells causality as a window
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:  # older kernels want as many key heads as query heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _per_sequence(q, k, v, cu, scale):
    out = torch.empty_like(q)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, n, dim]
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0]
        ).transpose(0, 1)
    return out


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    context_group: ContextGroup | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence: ``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out.
    With a ``context_group`` (``train.ulysses``) T is this rank's slice of the row the bounds describe."""
    if cu_seq_lens_q is None:
        raise ValueError(f"attention {ATTENTION!r} needs the packed sequences' bounds (packed_kwargs)")
    if dropout or sliding_window or query.shape[0] != 1:
        raise NotImplementedError(
            f"attention {ATTENTION!r} runs one packed row without dropout or a sliding window "
            f"(got batch {query.shape[0]}, dropout {dropout}, sliding_window {sliding_window})"
        )
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, dim]
    if context_group is None:
        return causal_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling)[None], None
    k, v = (ulysses.shared_kv_heads(x, context_group.size) for x in (k, v))
    q, k, v = (ulysses.heads_to_sequence(x, context_group) for x in (q, k, v))
    out = causal_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling)
    return ulysses.sequence_to_heads(out, context_group)[None], None


def causal_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention within each packed sequence: ``q [T, heads, dim]``, ``k``, ``v [T, kv_heads, dim]``
    -> ``[T, heads, dim]`` (the kernel as above)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _varlen(q, k, v, cu_seqlens, max_len, scale)
    return _per_sequence(q, k, v, cu_seqlens, scale)


AttentionInterface.register(ATTENTION, packed_attention)
