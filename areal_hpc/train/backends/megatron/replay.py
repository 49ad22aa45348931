"""Routing replay (``actor.router_replay: rollout``): the routers of a MoE model route each token to the experts
the generation server routed it to (the batch's ``packed_routed_experts``), so that the trainer's logprobs and
gradients are those of the policy that sampled, not of another mixture of experts.

megatron-core's router takes the replayed top-k (``RouterReplay``, REPLAY_FORWARD) and weights them with its own
probabilities, so gradients still reach the router. Its instances are set here router by router, per forward,
for this model's routers only (megatron-core's own helpers set every router of the process).
"""

from __future__ import annotations

import collections

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


class Replayer:
    """The routing of this model's routers, micro-batch by micro-batch.

    ``add`` queues a micro-batch's routing before its forward; each router takes it in a forward pre-hook: a
    forward without gradients (logprobs, or the first pass of a recomputed layer) the latest one, a forward
    with gradients (training, or the recomputation of a layer in the backward pass) the oldest one not yet
    taken. Recomputation runs the micro-batches in the order their forwards ran (also under 1F1B pipelining),
    so each takes its own."""

    def __init__(self, model_routers: list[TopKRouter], layout: Layout, sequence_parallel: bool):
        self.layout, self.sequence_parallel = layout, sequence_parallel
        self.queues = {router: collections.deque() for router in model_routers}
        self.latest: dict[TopKRouter, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recorded: dict[
            TopKRouter, torch.Tensor
        ] = {}  # the rows the server recorded, of the last forward
        for router in model_routers:
            router.register_forward_pre_hook(self._take)
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def start(self) -> None:
        """Before a schedule: nothing left from the last one (forwards without gradients take nothing)."""
        for queue in self.queues.values():
            queue.clear()

    def add(self, routed: torch.Tensor | None, tokens: int) -> None:
        """A micro-batch of ``tokens`` (padded) routed as ``routed [T, layers, k]``; None: a padding micro-batch,
        which trains nothing (its tokens go to experts 0..k-1)."""
        for router, queue in self.queues.items():
            k = router.topk
            if routed is None:
                chosen = torch.zeros(0, k, dtype=torch.long)
            else:
                chosen = routed[:, router.layer_number - 1].long()
            recorded = recorded_rows(chosen)
            # A row the server did not record goes to experts 0..k-1: such a token's output is never trained on.
            first_k = torch.arange(k, device=chosen.device)
            chosen = torch.where(recorded[:, None], chosen, first_k)
            local = (
                local_rows(chosen, tokens, self.layout, self.sequence_parallel, first_k),
                local_rows(recorded, tokens, self.layout, self.sequence_parallel, False),
            )
            queue.append(local)
            self.latest[router] = local

    def _take(self, router: TopKRouter, args) -> None:
        chosen, recorded = self.queues[router].popleft() if torch.is_grad_enabled() else self.latest[router]
        router.router_replay.target_topk_idx = chosen.to(args[0].device)
        self.recorded[router] = recorded.to(args[0].device)

    def own_choice_differs(self, router: TopKRouter, hidden: torch.Tensor, routing_map: torch.Tensor):
        """For each token the server recorded, whether the router's own top-k on ``hidden`` differs from the
        experts it was made to route to (``routing_map [T, E]``)."""
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)
            own = torch.zeros_like(routing_map).scatter_(1, logits.topk(router.topk, dim=-1).indices, True)
            return (own != routing_map).any(-1)[self.recorded[router]]
