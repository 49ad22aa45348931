"""What the Megatron engine adds for a mixture-of-experts model: the auxiliary losses' scale, statistics of the
routing, and the micro-batch shapes that expert and sequence parallelism need.

The auxiliary losses (load balancing, router z) follow the HF config: HF adds the load-balancing loss only when
``output_router_logits`` is set, with ``router_aux_loss_coef``; a z loss only with ``router_z_loss_coef``.
megatron-core attaches each micro-batch's loss times its token count (it expects the step's gradients to be
divided by the step's tokens afterwards; ours come normalised and are not): the coefficients are divided by the
step's tokens, so the auxiliary gradient is the token-weighted mean over the step, as the loss's is.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_hpc.train import dist
from areal_hpc.train.backends.megatron import replay
from areal_hpc.train.backends.megatron.convert import moe_layer

# megatron-core 0.16 leaves this name undefined without Transformer Engine, and the router's linear layer reads it.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

LOSSES = {"load_balancing_loss": "moe/load_balancing_loss", "z_loss": "moe/z_loss"}


def pad_to_multiple(ids: torch.Tensor, cu: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed micro-batch with a last sequence of padding tokens (id 0) so that its length is a multiple of
    ``multiple`` (sequence parallelism splits the tokens evenly over the TP ranks); unchanged if it is one."""
    pad = -len(ids) % multiple
    if not pad:
        return ids, cu
    return torch.cat([ids, ids.new_zeros(pad)]), torch.cat([cu, cu.new_tensor([len(ids) + pad])])


def padding_mask(real: int, padded: int, layout) -> torch.Tensor | None:
    """Megatron's ``padding_mask`` ``[1, tokens]`` (True: a real token) of a micro-batch of ``real`` tokens padded
    to ``padded``: padding is routed but counts in no auxiliary loss. The first stage scatters it over the TP ranks
    with the tokens; a later stage gets this TP rank's part already."""
    if real == padded:
        return None
    mask = torch.arange(padded) < real
    if not layout.first:
        mask = mask.chunk(layout.tp)[layout.tp_rank]
    return mask[None]


def most_micro_batches(count: int, group) -> int:
    """The most micro-batches any rank of ``group`` runs (the ranks of an expert-parallel group run as many)."""
    return int(dist.all_reduce(torch.tensor([count], dtype=torch.float64), "max", group)[0])


class MoeStats:
    """Per optimizer step: sets the auxiliary coefficients, counts each sparse layer's routed tokens and, under
    routing replay, the tokens whose replayed experts the router would not have chosen (forward hooks on the
    routers), and reports ``moe/*`` statistics over all ranks."""

    def __init__(self, hf: dict[str, Any], config: TransformerConfig):
        self.config = config
        self.sparse = [i for i in range(hf["num_hidden_layers"]) if moe_layer(hf, i)]
        balancing = hf.get("router_aux_loss_coef", 0.0) if hf.get("output_router_logits") else 0.0
        # Megatron sums one loss per layer; HF's is one over all layers: its scale, per layer.
        self.aux_coef = balancing / len(self.sparse)
        self.z_coef = hf.get("router_z_loss_coef") or 0.0
        self.counts = torch.zeros(hf["num_hidden_layers"], config.num_moe_experts, dtype=torch.float64)
        # (token, layer) pairs replayed, and those the router would have chosen otherwise
        self.replayed = torch.zeros(2, dtype=torch.float64)
        self.counting = False
        self.replayer: replay.Replayer | None = None  # set under routing replay

    def watch(self, model: torch.nn.Module) -> None:
        """Count the tokens each router of ``model`` sends to each expert while a training step runs (twice
        under activation recomputation, which leaves the imbalance, a ratio, unchanged)."""
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        if self.counting:
            _, routing_map = output
            mask = args[1] if len(args) > 1 else None  # [tokens, 1]: the real tokens (padding_mask)
            real = slice(None) if mask is None else mask.reshape(-1)
            self.counts[router.layer_number - 1] += routing_map[real].sum(0).to(self.counts)
            if self.replayer is not None:  # padding is not recorded
                differs = self.replayer.own_choice_differs(router, args[0], routing_map)
                self.replayed += torch.tensor([differs.numel(), differs.sum().item()], dtype=torch.float64)

    def start_step(self, local_tokens: int, dp_group) -> None:
        """Before a step's schedule: the coefficients over the step's tokens on all data-parallel ranks."""
        if self.config.sequence_parallel:  # each TP rank routes (and scales by) its share of the tokens
            local_tokens = local_tokens / self.config.tensor_model_parallel_size
        tokens = float(
            dist.all_reduce_sum(torch.tensor([float(local_tokens)], dtype=torch.float64), dp_group)[0]
        )
        self.config.moe_aux_loss_coeff = self.aux_coef / max(tokens, 1.0)
        self.config.moe_z_loss_coeff = self.z_coef / max(tokens, 1.0) if self.z_coef else None
        clear_aux_losses_tracker()
        self.counts.zero_()
        self.replayed.zero_()
        self.counting = True

    def end_step(self, groups, micro_batches: int) -> dict[str, float]:
        """After a step of ``micro_batches`` on this rank: the statistics over all ranks (a collective of the
        whole trainer group). The losses are means over the layers and the micro-batches of every replica."""
        self.counting = False
        tracker = get_moe_layer_wise_logging_tracker()
        losses = torch.zeros(len(LOSSES), self.counts.shape[0], dtype=torch.float64)
        for row, name in enumerate(LOSSES):
            if name in tracker:
                losses[row] = tracker[name]["values"].detach().double().cpu()
        last_stage = groups.pp.rank() == groups.pp.size() - 1  # where the results are
        replicas = float(groups.tp.rank() == 0 and last_stage) * micro_batches
        summed = dist.all_reduce_sum(
            torch.cat([losses.flatten(), self.counts.flatten(), self.replayed, torch.tensor([replicas])])
        )
        n_losses, n_counts = losses.numel(), self.counts.numel()
        losses = summed[:n_losses].view_as(losses)[:, self.sparse] / max(float(summed[-1]), 1.0)
        counts = summed[n_losses : n_losses + n_counts].view_as(self.counts)[self.sparse]
        replayed, differ = summed[n_losses + n_counts : -1].tolist()
        imbalance = counts.max(1).values / counts.mean(1).clamp(min=1e-9)
        stats = {
            f"moe/load_imbalance/layer{i}": float(x) for i, x in zip(self.sparse, imbalance, strict=True)
        }
        stats["moe/load_imbalance"] = float(imbalance.mean())
        if replayed:  # the share of (token, layer) routings the trainer would have made otherwise
            stats["moe/replay_mismatch"] = differ / replayed
        coefficients = {"load_balancing_loss": self.aux_coef, "z_loss": self.z_coef}
        for row, (name, key) in enumerate(LOSSES.items()):
            if coefficients[name]:
                stats[key] = float(losses[row].mean())
        return stats
