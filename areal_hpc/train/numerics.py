"""The numerics every training backend shares: token logprobs from logits, and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from areal_hpc.algo import align_next_token
from areal_hpc.config import OptimizerConfig

# A micro-batch's model output (logits [T, V] or values [T]) and its tensors -> its share of the minibatch loss.
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def lr_factor(step: int, total_steps: int, opt: OptimizerConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``opt.lr``.

    Linear warm-up over ``int(warmup_steps_proportion * total_steps)`` steps (the first step already gets a
    non-zero rate), then constant, or a linear or cosine decay that reaches ``min_lr_ratio`` at
    ``total_steps`` and stays there.
    """
    warmup = int(opt.warmup_steps_proportion * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if opt.lr_scheduler_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if opt.lr_scheduler_type == "linear":
        decay = 1.0 - progress
    elif opt.lr_scheduler_type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr_scheduler_type {opt.lr_scheduler_type!r}")
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * decay


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Token-aligned float32 ``log p(token t | tokens < t)`` from packed logits ``[T, V]`` (first tokens: 0).

    Logits are divided by ``temperature``, as in sampling.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    next_ids = torch.roll(input_ids, -1)  # the last token of a sequence gets garbage, dropped below
    picked = logits.gather(-1, next_ids[:, None]).squeeze(-1)
    return align_next_token(picked - logits.logsumexp(-1), cu_seqlens)
