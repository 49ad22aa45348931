"""Routing replay (``actor.router_replay: rollout``): the routers of a MoE model route each token to the experts
the generation server routed it to (the batch's ``packed_routed_experts``), so that the trainer's logprobs and
gradients are those of the policy that sampled, not of another mixture of experts.

megatron-core's router takes the replayed top-k (``RouterReplay``, REPLAY_FORWARD) and weights them with its own
probabilities, so gradients still reach the router. Its instances are set here router by router, per
micro-batch, from this model's routers only (megatron-core's own helpers set every router of the process).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from areal_hpc.train.backends.megatron.convert import Layout


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The routers of this rank's layers."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def recorded_rows(chosen: torch.Tensor) -> torch.Tensor:
    """Which rows of ``chosen [T, k]`` the server recorded: k distinct experts (a token it did not forward, the
    last one, has zeros)."""
    if chosen.shape[-1] == 1:
        return torch.ones(len(chosen), dtype=torch.bool, device=chosen.device)
    return (chosen.sort(-1).values.diff(dim=-1) != 0).all(-1)


def local_rows(
    rows: torch.Tensor, tokens: int, layout: Layout, sequence_parallel: bool, filler
) -> torch.Tensor:
    """The rows a router of this rank sees: padded with ``filler`` to the micro-batch's ``tokens``, then this TP
    rank's share under sequence parallelism."""
    pad = tokens - len(rows)
    if pad:
        rows = torch.cat([rows, torch.as_tensor(filler, device=rows.device).expand(pad, *rows.shape[1:])])
    return rows.chunk(layout.tp)[layout.tp_rank] if sequence_parallel else rows


def set_routing(
    model_routers: list[TopKRouter],
    routed: torch.Tensor | None,
    tokens: int,
    layout: Layout,
    sequence_parallel: bool,
) -> None:
    """Before a micro-batch's forward: each router replays its layer's column of ``routed [T, layers, k]``
    (None: the routers choose, as for a padding micro-batch)."""
    for router in model_routers:
        replay = router.router_replay
        replay.clear_indices()  # its backward list would grow a micro-batch at a time
        if routed is None:
            replay.clear_router_replay_action()
            continue
        chosen = routed[:, router.layer_number - 1].long()
        recorded = recorded_rows(chosen)
        # A row the server did not record routes to experts 0..k-1: such a token's output is never trained on.
        first_k = torch.arange(chosen.shape[-1], device=chosen.device)
        chosen = torch.where(recorded[:, None], chosen, first_k)
        replay.set_target_indices(local_rows(chosen, tokens, layout, sequence_parallel, first_k))
        replay.recorded = local_rows(recorded, tokens, layout, sequence_parallel, False)  # for statistics
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def replaying(router: TopKRouter) -> bool:
    replay = router.router_replay
    return replay is not None and replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD


def own_choice_differs(router: TopKRouter, hidden: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """For each token the server recorded, whether the router's own top-k on ``hidden`` differs from the
    experts it was made to route to (``routing_map [T, E]``)."""
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
        own = torch.zeros_like(routing_map).scatter_(1, logits.topk(router.topk, dim=-1).indices, True)
        return (own != routing_map).any(-1)[router.router_replay.recorded]
