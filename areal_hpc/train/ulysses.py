"""Ulysses sequence parallelism: the c ranks of a context group run one packed micro-batch together, each on a
contiguous slice of its tokens (allocation_mode's ``c``).

Everything but attention works token by token, so a rank runs the embeddings, norms, MLPs, projections, rotary
embeddings (from its tokens' own positions) and the LM head on its slice alone. Attention needs every token of a
sequence: around it an all-to-all trades the slice of all heads for all tokens of H/c heads, attention runs over
the whole packed row with the micro-batch's bounds, and a second all-to-all trades back (DeepSpeed-Ulysses).
KV heads that c does not divide are repeated first, as grouped-query attention reads them anyway.

The per-token outputs (logprobs, entropy, values) are gathered whole on every rank of the group, so the loss,
its normaliser and the statistics are computed as with one rank: the same on the c ranks. The gather's backward
keeps each rank's own slice of the gradient and sends nothing, because each rank computed that same loss; the
parameter gradients of the c ranks then add up (FSDP sums them over every rank) to that of the micro-batch.

A micro-batch whose length c does not divide gets a padding sequence at its end (attention keeps to its own
sequence, so it changes nothing else), dropped from the outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextGroup:
    """The ranks that share this rank's micro-batches: its ``rank`` among ``size``, over ``group``."""

    group: Any
    size: int
    rank: int

    def bounds(self, n_tokens: int) -> tuple[int, int]:
        """This rank's slice [start, end) of a row of ``n_tokens`` (a multiple of ``size``)."""
        part = n_tokens // self.size
        return self.rank * part, (self.rank + 1) * part


def context_groups(context: int) -> tuple[ContextGroup | None, Any]:
    """This rank's context group and its data-parallel group (the ranks of its CP rank in every context group,
    over which normalisers and statistics are reduced), both made on every rank (a collective). The ranks of
    a context group are consecutive (alloc's [data, context] order). (None, None) when ``context`` is 1."""
    if context == 1:
        return None, None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % context:
        raise ValueError(f"context size {context} does not divide the {world} trainer ranks")
    mine = data = None
    for first in range(0, world, context):  # every rank makes every group, in the same order
        group = dist.new_group(list(range(first, first + context)))
        if first <= rank < first + context:
            mine = ContextGroup(group, context, rank - first)
    for cp in range(context):
        group = dist.new_group(list(range(cp, world, context)))
        if rank % context == cp:
            data = group
    return mine, data


def padded(cu_seqlens: torch.Tensor, multiple: int) -> torch.Tensor:
    """``cu_seqlens`` with a padding sequence at the end that makes the row a multiple of ``multiple`` long
    (unchanged when it is one)."""
    n = int(cu_seqlens[-1])
    extra = -n % multiple
    return torch.cat([cu_seqlens, cu_seqlens[-1:] + extra]) if extra else cu_seqlens


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps the strides of a transposed input
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """An all-to-all of equal chunks; its gradient is the same exchange backwards."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def heads_to_sequence(x: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
    """``[T/c, heads, dim]`` of this rank's tokens -> ``[T, heads/c, dim]``: every token, this rank's heads."""
    n, heads, dim = x.shape
    chunks = x.reshape(n, cg.size, heads // cg.size, dim).transpose(0, 1)  # [c, T/c, heads/c, dim]
    return _AllToAll.apply(chunks, cg.group).reshape(cg.size * n, heads // cg.size, dim)


def sequence_to_heads(x: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
    """The inverse of ``heads_to_sequence``: ``[T, heads/c, dim]`` -> ``[T/c, heads, dim]``."""
    n, heads, dim = x.shape
    chunks = _AllToAll.apply(x.reshape(cg.size, n // cg.size, heads, dim), cg.group)  # [c, T/c, heads/c, dim]
    return chunks.transpose(0, 1).reshape(n // cg.size, cg.size * heads, dim)


def shared_kv_heads(k: torch.Tensor, context: int) -> torch.Tensor:
    """KV heads ``[n, kv, dim]`` repeated (each next to itself) until ``context`` divides them: query head h
    still reads what it read, as h // (heads / kv) maps onto the repeats in order."""
    repeat = context // math.gcd(k.shape[1], context)
    return k.repeat_interleave(repeat, dim=1) if repeat > 1 else k


class _GatherSlices(torch.autograd.Function):
    """Every rank's slice, concatenated in rank order; backward keeps this rank's slice of the gradient (each
    rank computes the same loss from the whole, see the module's docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
        ctx.cg, ctx.n, x = cg, x.shape[0], x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cg.size)]
        dist.all_gather(parts, x, group=cg.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.cg.rank * ctx.n
        return grad[start : start + ctx.n], None


def gather_slices(x: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
    """Per-token values of this rank's slice ``[T/c, ...]`` -> those of the whole row ``[T, ...]``."""
    return _GatherSlices.apply(x, cg)
