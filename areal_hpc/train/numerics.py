"""The numerics every training backend shares: token logprobs from logits, the optimizer and its learning-rate
schedule."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch.distributed.tensor import DTensor

from areal_hpc.algo import align_next_token
from areal_hpc.config import OptimizerConfig

logger = logging.getLogger(__name__)

# A micro-batch's float32 per-token model outputs and its tensors -> its share of the minibatch loss.
# Outputs of an LM: "logprobs" (token-aligned, with the gradient) and "entropy" (for monitoring: no gradient);
# of a value model: "values".
LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]


def make_optimizer(model: torch.nn.Module, opt: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on biases and norm scales (the 1-D ones)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


def make_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, opt: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of ``lr_factor`` over ``total_steps`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, total_steps=max(1, total_steps), opt=opt)
    )


def clipped_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: list[torch.nn.Parameter],
    max_norm: float,
    update: Callable[[], None] | None = None,
    skip: bool = False,
) -> dict[str, float]:
    """Clip the (already summed) gradients of ``params``, update (``optimizer.step`` unless ``update`` is
    given), step the LR schedule; ``grad_norm`` (before clipping, of every shard when sharded) and ``lr``.

    ``skip`` (the same on every rank), or a non-finite gradient norm, leaves the weights as they are (the norm
    is of the summed gradient, so every rank skips alike).
    """
    for p in params:  # a parameter no micro-batch used contributes zero
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    lr = optimizer.param_groups[0]["lr"]
    if skip:
        logger.info("skipping this optimizer step, as asked (gradient norm %s)", grad_norm)
    elif math.isfinite(grad_norm):
        (update or optimizer.step)()
    else:
        logger.warning("gradient norm is %s: skipping this optimizer step", grad_norm)
    with warnings.catch_warnings():  # a skipped first step is meant: the schedule counts minibatches
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr}


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


def token_entropy(logits: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned float32 entropy of the distribution each token was drawn from (first tokens: 0); no
    gradient."""
    entropy = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for start in range(0, logits.shape[0], 2048):  # rows at a time: no second [T, V] float32 copy
            logp = torch.log_softmax(logits[start : start + 2048].float() / temperature, -1)
            entropy[start : start + 2048] = -(logp.exp() * logp).sum(-1)
    return align_next_token(entropy, cu_seqlens)
