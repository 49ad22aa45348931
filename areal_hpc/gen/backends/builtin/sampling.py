"""Next-token sampling for a batch of rows, each with its own temperature, top-p, top-k and random stream.

The logprob returned for a token is ``log_softmax(logits / temperature)`` of that token over the WHOLE vocabulary
(``log_softmax(logits)`` when greedy): top-k, top-p and the min_new_tokens ban only restrict which tokens may be
drawn. That is the quantity a trainer recomputes from the same logits, as SGLang reports it.
"""

from __future__ import annotations

import torch

# Temperatures at or below this are greedy (SGLang treats tiny temperatures the same way).
GREEDY_TEMPERATURE = 1e-5


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k and top-p nucleus (top_k >= vocab, top_p 1: no-op)."""
    vocab = logits.shape[-1]
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    probs = sorted_logits.softmax(dim=-1)
    # A token is kept while the probability mass BEFORE it is below top_p, so the most likely token always is.
    drop = (ranks[None, :] >= top_k[:, None]) | (probs.cumsum(dim=-1) - probs > top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def draw_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform number in [0, 1) per row, each from the row's own CPU generator.

    A row's random stream does not depend on which other rows share its batch, so sampling is reproducible
    under any batching and on any device.
    """
    return torch.tensor([torch.rand(1, generator=g).item() for g in generators], dtype=torch.float64)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: list[torch.Generator],
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] long, logprobs [B] float32).

    ``temperature``, ``top_p`` [B] float and ``top_k`` [B] long (>= V for no limit) are per row; ``banned``
    [B, V] bool marks tokens a row may not draw now (stop tokens before min_new_tokens).
    """
    logits = logits.float()
    greedy = temperature <= GREEDY_TEMPERATURE
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits)
    scaled = logits / scale[:, None]
    logprobs = scaled.log_softmax(dim=-1)

    allowed = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    allowed = filter_top_k_top_p(allowed, top_k.to(logits.device), top_p.to(logits))
    probs = allowed.softmax(dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    # Inverse-CDF draw; right=True never lands on a zero-probability token.
    u = draw_uniforms(generators).to(logits.device)[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy.to(logits.device), allowed.argmax(dim=-1), drawn)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
