"""The routed experts of a mixture-of-experts layer: this expert-parallel rank's experts as two stacked
weights, computed as grouped matrix products over the tokens sorted by expert.

Megatron's own grouped experts need Transformer Engine or the ``grouped_gemm`` package, and its SequentialMLP runs
one small matmul per expert (128 of them per layer for Qwen3-30B-A3B). Here bf16 on CUDA is one
``torch._grouped_mm`` per projection (a CUTLASS grouped GEMM); elsewhere (the CPU test ranks, float32) one matmul
per expert. The weights keep the HF in-memory layout of the experts (``[E, 2I, H]`` gate and up, ``[E, H, I]``
down), so conversion is a stack per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int], offsets: torch.Tensor | None):
    """``x [N, K]`` (rows sorted by group, ``counts`` rows each) times each group's ``weight[g].T`` (``weight``
    ``[G, M, K]``) -> ``[N, M]``; ``offsets``: the cumulative counts as int32 on x's device (the fast path)."""
    if offsets is not None:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    parts = x.split(counts)
    return torch.cat([p @ w.T for p, w in zip(parts, weight.unbind(), strict=True)])


class GroupedExperts(MegatronModule):
    """Megatron's ``experts`` module of a MoE layer: ``forward(tokens [N, H] sorted by local expert,
    tokens_per_expert [E_local], probs [N]) -> (out [N, H], None)``, each token's SwiGLU expert output
    weighted by its routing probability (HF's order: weighted after the down projection)."""

    def __init__(
        self, num_local_experts: int, config: TransformerConfig, submodules=None, pg_collection=None
    ):
        super().__init__(config=config)
        hidden, inner = config.hidden_size, config.moe_ffn_hidden_size
        self.num_local_experts = num_local_experts
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        make = dict(dtype=config.params_dtype, device=device)
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * inner, hidden, **make))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, hidden, inner, **make))
        for weight in (self.fc1_weight, self.fc2_weight):
            # Megatron's DDP and optimizer reduce and shard a weight with allreduce False over the expert
            # data-parallel group: all ranks holding the same experts. That is the data-parallel group only
            # without expert and tensor parallelism: with TP (sequence parallel) each TP rank computes its
            # tokens' share of the gradient, which the data-parallel group alone would not sum.
            weight.allreduce = False

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        counts = tokens_per_expert.tolist()
        offsets = None
        if tokens.is_cuda and tokens.dtype == torch.bfloat16:
            offsets = tokens_per_expert.to(tokens.device, non_blocking=True).cumsum(0).to(torch.int32)
        gate, up = grouped_mm(tokens, self.fc1_weight, counts, offsets).chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.fc2_weight, counts, offsets)
        return (out * probs[:, None]).to(tokens.dtype), None

    def backward_dw(
        self,
    ):  # Megatron's split weight-gradient pass (not used: gradients come with the backward)
        pass
