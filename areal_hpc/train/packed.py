"""Packed micro-batches without padding: the sequences of a micro-batch laid end to end as one row, attention
confined to each sequence.

The HF model runs on ``input_ids [1, T]`` with ``position_ids`` restarting at 0 for every sequence (the rotary
embedding of each token is that of its sequence alone) and the attention function registered here under
``ATTENTION``, which reads the sequences' bounds from ``cu_seq_lens_q``/``max_length_q`` (the names
transformers passes through to attention, as for FlashAttention's varlen kernels):

- on CUDA in bf16 or fp16, PyTorch's varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``): no
  padding, no mask; a sequence of ``CUDNN_FROM`` tokens or more runs alone through cuDNN's fused attention
  on Hopper GPUs and later, where torch has it (1.7x FlashAttention-2's speed on an H100 at 8k-64k tokens:
  issue 48, docs/benchmarks.md);
- otherwise (the CPU tests, float32), causal SDPA over each sequence in turn: exact, and fast enough for tiny
  models.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from areal_hpc.train import ulysses
from areal_hpc.train.ulysses import ContextGroup

log = logging.getLogger(__name__)
ATTENTION = "areal_packed"
# A sequence this long or longer runs alone through cuDNN's attention, padded at its end to a multiple of
# CUDNN_PAD (causal: padding after a token changes nothing before it): cuDNN builds a plan for each new length
# and keeps it, so RL's ever-new answer lengths would build one per micro-batch and grow the cache without end.
# 8k: the shortest length tools/bench_attention.py measured, where cuDNN already ran forward and backward 1.7x
# as fast as varlen FlashAttention-2 on an H100 (a 7B at 32k: 33.3% -> 39.0% MFU). None: all on FlashAttention.
CUDNN_FROM: int | None = 8192
CUDNN_SINCE = (9, 0)  # Hopper on: where it was measured (an A100's cuDNN against FlashAttention-2 was not)
CUDNN_PAD = 256


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


def segments(bounds: list[int], alone_from: int) -> list[tuple[int, int, bool]]:
    """The packed row cut into ``(start, end, alone)``: each sequence of ``alone_from`` tokens or more alone,
    each run of shorter ones between them together."""
    cuts: list[tuple[int, int, bool]] = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone = end - start >= alone_from
        if cuts and not alone and not cuts[-1][2]:
            cuts[-1] = (cuts[-1][0], end, False)
        else:
            cuts.append((start, end, alone))
    return cuts


@functools.cache
def _cudnn_ok(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether cuDNN's attention runs this shape forward and backward here: tried once on a small sequence."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < CUDNN_SINCE:
        return False
    try:  # its own graph wherever the first long sequence comes: a logprob pass, a checkpointed layer's hooks
        with torch.inference_mode(False), torch.enable_grad(), saved_tensors_hooks(_same, _same):
            q, k, v = (torch.ones(CUDNN_PAD - 1, h, dim, device=device, dtype=dtype, requires_grad=True)
                       for h in (heads, kv_heads, kv_heads))  # fmt: skip
            out = _cudnn(q, k, v, None)
            torch.autograd.backward(out, torch.ones_like(out))
    except RuntimeError as exc:  # no cuDNN attention in this torch, GPU or shape: the varlen kernel only
        log.warning("cuDNN attention is not usable for %d/%d heads of %d (%s): long sequences use FlashAttention",
                    heads, kv_heads, dim, str(exc).splitlines()[0][:200])  # fmt: skip
        return False
    return True


def _same(x):
    return x


def _cudnn(q, k, v, scale):
    """One causal sequence ``[n, heads, dim]`` through cuDNN's attention, padded to a multiple of CUDNN_PAD."""
    n = q.shape[0]
    pad = -n % CUDNN_PAD
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out[0, :, :n].transpose(0, 1)


def _long_alone(q, k, v, cu, max_len, scale):
    """The varlen kernel over runs of short sequences, cuDNN's over each long one alone."""
    bounds = cu.tolist()
    pieces = []
    for start, end, alone in segments(bounds, CUDNN_FROM):
        qs, ks, vs = q[start:end], k[start:end], v[start:end]
        if alone:
            pieces.append(_cudnn(qs, ks, vs, scale))
        else:
            run = torch.tensor([b - start for b in bounds if start <= b <= end], dtype=cu.dtype).to(cu.device)
            pieces.append(_varlen(qs, ks, vs, run, min(max_len, CUDNN_FROM - 1), scale))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


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
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return _per_sequence(q, k, v, cu_seqlens, scale)
    if (
        CUDNN_FROM is not None
        and max_len >= CUDNN_FROM
        and _cudnn_ok(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    ):
        return _long_alone(q, k, v, cu_seqlens, max_len, scale)
    return _varlen(q, k, v, cu_seqlens, max_len, scale)


AttentionInterface.register(ATTENTION, packed_attention)
