"""Token logprobs and entropy of the LM head without the full ``[tokens, vocab]`` logits.

A 16k-token micro-batch of a Qwen model (vocab 151,936) has 10 GB of float32 logits, and autograd through
``log_softmax`` keeps several such tensors alive until backward. Here the logits exist one chunk of rows
at a time, in forward and again in backward (recomputed: one more head matmul per chunk, cheap next to
the transformer), and only O(T) floats are kept between the two.

On CUDA each chunk's work (the head matmul and the float32 softmax arithmetic after it) is compiled
(torch.compile): the elementwise passes over the [chunk, vocab] logits fuse into a few kernels, and the
float32 copies of the logits are never written out. Without it they cost twice the head's matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

HEAD_CHUNK_TOKENS = 4096  # the engines' LM-head rows per chunk: Qwen's [4096, 151936] bf16 logits are 1.2 GB


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(hidden @ weight.T).float() / temperature``: matmul in the inputs' dtype, the rest in float32.

    Always a fresh tensor that the caller may overwrite in place.
    """
    logits = hidden @ weight.T
    if logits.dtype != torch.float32:
        logits = logits.float()  # a fresh copy
    return logits if temperature == 1.0 else logits.div_(temperature)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)  # dynamic: the last chunk of every micro-batch is shorter


def kernel(fn: Callable, device: torch.device) -> Callable:
    """``fn`` compiled on CUDA; eager elsewhere (the CPU tests, bit for bit the arithmetic of the pins)."""
    return _compiled(fn) if device.type == "cuda" else fn


def _chunks(total: int, chunk_tokens: int) -> list[slice]:
    return [slice(s, min(s + chunk_tokens, total)) for s in range(0, total, chunk_tokens)]


def _chunk_forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's ``(logp of labels, entropy, logsumexp)``; its logits die on return."""
    z = _scaled_logits(hidden, weight, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z.sub_(lse[:, None])  # log-softmax in place: z is not needed any more
    # -(p * log p) with log p in its shifted form: no cancellation, unlike lse - sum(p * z).
    entropy = -logp_all.exp().mul_(logp_all).sum(-1)
    return logp_all.gather(1, labels[:, None]).squeeze(1), entropy, lse


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(logp of labels, entropy, logsumexp)``, all float32 and of length T."""
    out = [torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) for _ in range(3)]
    chunk_forward = kernel(_chunk_forward, hidden.device)
    for c in _chunks(hidden.shape[0], chunk_tokens):
        for o, value in zip(out, chunk_forward(hidden[c], weight, labels[c], temperature), strict=True):
            o[c] = value
    return out[0], out[1], out[2]


def _chunk_dlogits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    g_label: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk's gradient w.r.t. its raw logits ``hidden @ weight.T``, from recomputed logits, computed in
    float32 and returned in ``hidden``'s dtype (the dtype of the matmuls it goes into).

    With z = logits / temperature, p = softmax(z) and H the entropy, w.r.t. z:
        dz_j = g_logp ([j = label] - p_j) - g_ent p_j (log p_j + H)
             = -p_j (g_logp + g_ent (log p_j + H)) + g_logp [j = label],
    and ``g_logp``, ``g_ent`` (the outputs' gradients) come already divided by the temperature, which turns
    that into the gradient w.r.t. the raw logits. At most two chunk-sized float32 tensors are alive at once.
    ``g_label`` (default ``g_logp``) is what the label's column gets: 0 where the label is another rank's.
    """
    logp_all = _scaled_logits(hidden, weight, temperature).sub_(lse[:, None])
    if g_ent is None:
        dz = logp_all.exp_().mul_(-g_logp[:, None])
    else:
        p = logp_all.exp()
        coef = logp_all.add_(entropy[:, None]).mul_(g_ent[:, None])
        if g_logp is not None:
            coef.add_(g_logp[:, None])
        dz = coef.mul_(p).neg_()
    if g_logp is not None:
        dz.scatter_add_(1, labels[:, None], (g_logp if g_label is None else g_label)[:, None])
    return dz.to(hidden.dtype)


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` into float32 ``total``, for ``a``, ``b`` in any one dtype."""
    if a.dtype == torch.float32:
        total.addmm_(a, b)
    elif a.is_cuda:  # cuBLAS adds the float32 product: no low-precision [V, H] product in between
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:  # a low-precision product first: addmm_ does not mix dtypes on the CPU
        total += a @ b


class _ChunkedLogprobs(torch.autograd.Function):
    """Saves hidden, weight, labels and two length-T vectors; backward recomputes the logits by chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens):
        logp, entropy, lse = _forward(hidden, weight, labels, temperature, chunk_tokens)
        # The entropy is saved for its own gradient, -p (log p + H): O(T), no second pass over the vocab.
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        # A loss that ignores one output then gets None for its grad, and backward skips that term.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable  # backward itself is not differentiable: no double backward through the head
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None
        # d/d(raw logits) = d/dz / temperature; folded into the per-token coefficients, O(T) not O(T*V).
        tau = ctx.temperature
        g_logp = None if grad_logp is None else grad_logp.float() / tau
        g_ent = None if grad_entropy is None else grad_entropy.float() / tau
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # float32 accumulation over chunks; each chunk's product is one matmul in the inputs' dtype.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            chunk_dlogits = kernel(_chunk_dlogits, hidden.device)
            for c in _chunks(hidden.shape[0], ctx.chunk_tokens):
                h = hidden[c]
                g_logp_c = None if g_logp is None else g_logp[c]
                g_ent_c = None if g_ent is None else g_ent[c]
                dz = chunk_dlogits(h, weight, labels[c], lse[c], entropy[c], g_logp_c, g_ent_c, tau)
                if need_hidden:
                    grad_hidden[c] = dz @ weight
                if need_weight:
                    _accumulate(grad_weight, dz.T, h)
                del dz  # else it lives on beside the next chunk's logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``log p(labels[t])`` and float32 entropy at each position t of
    ``softmax(hidden @ weight.T / temperature)``, never holding more than ``chunk_tokens`` rows of logits.

    ``hidden`` is ``[T, H]`` (the final hidden states), ``weight`` the LM head's ``[V, H]`` (an FSDP2
    unsharded parameter inside a module's forward is fine), both bf16 or both float32; ``labels`` is ``[T]``
    int64. The logits are the matmul in the inputs' dtype, cast to float32, divided by ``temperature``
    (as in sampling), with any caller's autocast disabled, so that training and inference agree with
    ``token_logprobs`` on unchunked logits. Both outputs have gradients w.r.t. ``hidden`` and ``weight``
    (the entropy's for an entropy bonus; a loss that ignores it pays nothing for it in backward).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got {tuple(labels.shape)}")
    if chunk_tokens < 1 or temperature <= 0:
        raise ValueError(f"need chunk_tokens >= 1 and temperature > 0, got {chunk_tokens}, {temperature}")
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _ChunkedLogprobs.apply(hidden, weight, labels, float(temperature), chunk_tokens)
        logp, entropy, _ = _forward(hidden, weight, labels, temperature, chunk_tokens)
        return logp, entropy


# --- the vocabulary split over tensor-parallel ranks ----------------------------------------------------------


def _global_lse(lse: torch.Tensor, group) -> torch.Tensor:
    """The logsumexp over the whole vocabulary from every rank's logsumexp over its slice."""
    parts = torch.empty(group.size() * lse.numel(), dtype=lse.dtype, device=lse.device)
    torch.distributed.all_gather_into_tensor(parts, lse.contiguous(), group=group)  # flat: gloo needs it
    return torch.logsumexp(parts.view(group.size(), -1), dim=0)


def _local_labels(labels: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as columns of this rank's slice ``[start, start + size)`` (0 where outside), and the inside mask."""
    local = labels - start
    inside = (local >= 0) & (local < size)
    return torch.where(inside, local, 0), inside


def _vocab_parallel_forward(hidden, weight, labels, temperature, chunk_tokens, group):
    """Per-token ``(logp, entropy, logsumexp)`` over the whole vocabulary, and the labels as local columns."""
    start = torch.distributed.get_rank(group) * weight.shape[0]
    local, inside = _local_labels(labels, start, weight.shape[0])
    n = hidden.shape[0]
    logp, entropy, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
    for c in _chunks(n, chunk_tokens):
        z = _scaled_logits(hidden[c], weight, temperature)
        lse[c] = _global_lse(torch.logsumexp(z, dim=-1), group)
        logp_all = z.sub_(lse[c][:, None])
        sums = torch.stack(
            [
                -logp_all.exp().mul_(logp_all).sum(-1),
                torch.where(inside[c], logp_all.gather(1, local[c][:, None]).squeeze(1), 0.0),
            ]
        )
        del z, logp_all
        torch.distributed.all_reduce(sums, group=group)
        entropy[c], logp[c] = sums[0], sums[1]
    return logp, entropy, lse, local, inside


class _VocabParallelLogprobs(torch.autograd.Function):
    """``_ChunkedLogprobs`` with ``weight`` this rank's rows of the vocabulary: per chunk, the logsumexp is
    gathered from all ranks, and the entropy and the label's logp (from the rank that holds it) are summed.
    Backward sums ``hidden``'s gradient over the ranks; ``weight``'s stays this rank's."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, group):
        logp, entropy, lse, local, inside = _vocab_parallel_forward(
            hidden, weight, labels, temperature, chunk_tokens, group
        )
        ctx.save_for_backward(hidden, weight, local, inside, lse, entropy)
        ctx.temperature, ctx.chunk_tokens, ctx.group = temperature, chunk_tokens, group
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local, inside, lse, entropy = ctx.saved_tensors
        none = (None,) * 6
        if grad_logp is None and grad_entropy is None:
            return none
        tau = ctx.temperature
        g_logp = None if grad_logp is None else grad_logp.float() / tau
        g_ent = None if grad_entropy is None else grad_entropy.float() / tau
        g_label = None if g_logp is None else torch.where(inside, g_logp, 0.0)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for c in _chunks(hidden.shape[0], ctx.chunk_tokens):
                h = hidden[c]
                dz = _chunk_dlogits(
                    h,
                    weight,
                    local[c],
                    lse[c],
                    entropy[c],
                    None if g_logp is None else g_logp[c],
                    None if g_ent is None else g_ent[c],
                    tau,
                    None if g_label is None else g_label[c],
                )
                grad_hidden[c] = dz @ weight
                _accumulate(grad_weight, dz.T, h)
                del dz
        torch.distributed.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_logprobs`` with the LM head's rows split over the ranks of ``group`` in rank order: ``weight``
    is this rank's ``[V / n, H]``, ``hidden`` and ``labels`` are the same on every rank, and so are the outputs.
    A collective of ``group`` (two per chunk in forward, one in backward)."""
    if group is None or group.size() == 1:
        return chunked_logprobs(hidden, weight, labels, temperature, chunk_tokens)
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _VocabParallelLogprobs.apply(
                hidden, weight, labels, float(temperature), chunk_tokens, group
            )
        logp, entropy, *_ = _vocab_parallel_forward(hidden, weight, labels, temperature, chunk_tokens, group)
        return logp, entropy
