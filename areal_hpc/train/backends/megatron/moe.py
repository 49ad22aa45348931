"""What the Megatron engine adds for a mixture-of-experts model: the auxiliary losses' scale, statistics of the
routing, and the micro-batch shapes that expert and sequence parallelism need.

The auxiliary losses follow the HF config: the load-balancing loss only when ``output_router_logits`` is set,
with ``router_aux_loss_coef``; a router z loss only with ``router_z_loss_coef``. Padding tokens (``padding_mask``,
True: padding, as megatron-core reads it) are routed but count in neither.

Load balancing. With E experts chosen top-k, for a sparse layer over T tokens: f_i = the choices of expert i / T
(the f_i sum to k) and P_i = the mean router probability of expert i (a softmax over all experts).

- HF (``load_balancing_loss_func``) pools the router logits of all N sparse layers and computes ONE loss over the
  T * N rows: E * sum_i mean_l(f_i^l) * mean_l(P_i^l).
- megatron-core computes one loss per layer, E / k * sum_i f_i^l * P_i^l, and sums them. That is L_l / k, where
  L_l = E * sum_i f_i^l * P_i^l is HF's loss of layer l alone.

Each layer's coefficient is ``router_aux_loss_coef * k / N``: the trainer optimises the coefficient times
mean_l L_l. With one sparse layer that is HF's loss. With several, HF's pooled loss is
mean_l L_l - E * sum_i cov_l(f_i^l, P_i^l) (the covariance over the layers): the two agree only where loads and
probabilities do not vary together over the layers. We match the mean of the per-layer losses: HF's gradient
pushes each layer's probabilities by the load of all the layers (mean_l f_i^l), which a layer cannot know in its
own forward; here each router is pushed by its own load (the Switch Transformer's form, megatron-core's).
HF's loss is one per forward; here one per micro-batch (f over all of its tokens, on every TP rank).

The z loss is megatron-core's: per sparse layer, the coefficient times the mean over the tokens of
logsumexp(router logits)^2, summed over the layers (HF's Qwen MoE models compute none).

Scale over the step. megatron-core attaches each micro-batch's auxiliary loss times its token count (it expects
the step's gradients to be divided by the step's tokens afterwards; ours come normalised and are not): the
coefficients are divided by the step's tokens, so the auxiliary gradient is the token-weighted mean over the
step, as the loss's is. Under sequence parallelism each TP rank attaches its part of the balancing loss times
its share of the tokens (``_even_token_count``) and its z loss over its own tokens with the coefficient divided
by the TP size: summed over the TP ranks, each is the micro-batch's loss times its tokens / TP, so the
coefficients are divided by the step's tokens / TP.

Statistics (no coefficient): ``moe/load_balancing_loss`` is the mean over the step's micro-batches and the sparse
layers of L_l, i.e. HF's ``aux_loss`` of a forward of the micro-batch where the model has one sparse layer;
``moe/z_loss`` the mean over the sparse layers of the mean over the step's real tokens of
logsumexp(router logits)^2, the z loss the trainer optimises per layer divided by its coefficient.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as megatron_router
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

_megatron_token_count = megatron_router.get_tokens_per_expert_and_token_count


def _even_token_count(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """megatron-core's counts for a router's balancing loss, this TP rank's tokens taken as its even share of
    the micro-batch's real tokens. megatron-core weighs each rank's part of the loss by the rank's own real
    tokens, which differ where padding lies on the last ranks; the parts are of one loss over the whole
    micro-batch (the router's gradient is summed over the TP ranks), so they must weigh alike."""
    per_expert, _, total = _megatron_token_count(routing_map, reduce_group, topk, with_padding_mask)
    return per_expert, total / reduce_group.size(), total


megatron_router.get_tokens_per_expert_and_token_count = _even_token_count

LOSSES = {"load_balancing_loss": "moe/load_balancing_loss", "z_loss": "moe/z_loss"}


def pad_to_multiple(ids: torch.Tensor, cu: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed micro-batch with a last sequence of padding tokens (id 0) so that its length is a multiple of
    ``multiple`` (sequence parallelism splits the tokens evenly over the TP ranks); unchanged if it is one."""
    pad = -len(ids) % multiple
    if not pad:
        return ids, cu
    return torch.cat([ids, ids.new_zeros(pad)]), torch.cat([cu, cu.new_tensor([len(ids) + pad])])


def padding_mask(real: int, padded: int, layout) -> torch.Tensor | None:
    """Megatron's ``padding_mask`` ``[1, tokens]`` (True: padding) of a micro-batch of ``real`` tokens padded to
    ``padded``: padding is routed but counts in no auxiliary loss. The first stage scatters it over the TP ranks
    with the tokens; a later stage gets this TP rank's part already."""
    if real == padded:
        return None
    mask = torch.arange(padded) >= real
    if not layout.first:
        mask = mask.chunk(layout.tp)[layout.tp_rank]
    return mask[None]


def most_micro_batches(count: int, group) -> int:
    """The most micro-batches any rank of ``group`` runs (the ranks of an expert-parallel group run as many)."""
    return int(dist.all_reduce(torch.tensor([count], dtype=torch.float64), "max", group)[0])


class MoeStats:
    """Per optimizer step: sets the auxiliary coefficients, counts each sparse layer's routed tokens, takes its
    auxiliary losses and, under routing replay, counts the tokens whose replayed experts the router would not
    have chosen (forward hooks on the routers), and reports ``moe/*`` statistics over all ranks."""

    def __init__(self, hf: dict[str, Any], config: TransformerConfig):
        self.config = config
        self.sparse = [i for i in range(hf["num_hidden_layers"]) if moe_layer(hf, i)]
        balancing = hf.get("router_aux_loss_coef", 0.0) if hf.get("output_router_logits") else 0.0
        self.topk = config.moe_router_topk
        # megatron-core's loss of a layer is HF's / top_k: HF's scale, as the mean over the layers
        self.aux_coef = balancing * self.topk / len(self.sparse)
        self.z_coef = hf.get("router_z_loss_coef") or 0.0
        self.counts = torch.zeros(hf["num_hidden_layers"], config.num_moe_experts, dtype=torch.float64)
        # per layer: this rank's parts of the micro-batches' balancing losses (megatron-core's scale), its sum of
        # the z loss over its real tokens, and those tokens
        self.losses = torch.zeros(3, hf["num_hidden_layers"], dtype=torch.float64)
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
            mask = args[1] if len(args) > 1 else None  # [tokens, 1], True: padding (padding_mask)
            real = slice(None) if mask is None else ~mask.reshape(-1)
            layer = router.layer_number - 1
            routed = routing_map[real]
            self.counts[layer] += routed.sum(0).to(self.counts)
            if torch.is_grad_enabled():  # the pass where megatron-core adds (and tracks) the auxiliary losses
                self._take_losses(layer, len(routed))
            if self.replayer is not None:  # padding is not recorded
                differs = self.replayer.own_choice_differs(router, args[0], routing_map)
                self.replayed += torch.tensor([differs.numel(), differs.sum().item()], dtype=torch.float64)

    def _take_losses(self, layer: int, tokens: int) -> None:
        """Move a router call's losses out of megatron-core's tracker: the balancing loss as it is (this rank's
        part), the z loss, which it tracks as the mean over this rank's real ``tokens``, times them (the step's is
        a mean per token)."""
        tracker = get_moe_layer_wise_logging_tracker()
        for row, (name, weight) in enumerate([("load_balancing_loss", 1), ("z_loss", tokens)]):
            if name in tracker:
                values = tracker[name]["values"]
                self.losses[row, layer] += (values[layer] * weight).to(self.losses)
                values[layer] = 0
        self.losses[2, layer] += tokens

    def start_step(self, local_tokens: int, dp_group) -> None:
        """Before a step's schedule: the coefficients over the step's tokens on all data-parallel ranks."""
        if self.config.sequence_parallel:  # each TP rank attaches its part times its share of the tokens
            local_tokens = local_tokens / self.config.tensor_model_parallel_size
        tokens = float(
            dist.all_reduce_sum(torch.tensor([float(local_tokens)], dtype=torch.float64), dp_group)[0]
        )
        self.config.moe_aux_loss_coeff = self.aux_coef / max(tokens, 1.0)
        self.config.moe_z_loss_coeff = self.z_coef / max(tokens, 1.0) if self.z_coef else None
        clear_aux_losses_tracker()
        self.counts.zero_()
        self.losses.zero_()
        self.replayed.zero_()
        self.counting = True

    def end_step(self, groups, micro_batches: int) -> dict[str, float]:
        """After a step of ``micro_batches`` on this rank: the statistics over all ranks (a collective of the
        whole trainer group); the losses as the module's docstring says."""
        self.counting = False
        last_stage = groups.pp.rank() == groups.pp.size() - 1  # where the results are
        replicas = float(groups.tp.rank() == 0 and last_stage) * micro_batches
        summed = dist.all_reduce_sum(
            torch.cat([self.losses.flatten(), self.counts.flatten(), self.replayed, torch.tensor([replicas])])
        )
        n_losses, n_counts = self.losses.numel(), self.counts.numel()
        balancing, z, tokens = summed[:n_losses].view_as(self.losses)[:, self.sparse]
        losses = {  # per sparse layer: HF's scale, a mean per micro-batch; a mean per token
            "load_balancing_loss": balancing * self.topk / max(float(summed[-1]), 1.0),
            "z_loss": z / tokens.clamp(min=1.0),
        }
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
        for name, key in LOSSES.items():
            if coefficients[name]:
                stats[key] = float(losses[name].mean())
        return stats
