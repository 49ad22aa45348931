"""The mixture-of-experts layers of the decoder (Qwen2-MoE, Qwen3-MoE): router, experts and shared expert.

The experts of a layer live in two fused tensors, laid out as transformers 5 holds them in memory (gate and up
[E, 2I, H], down [E, H, I]). Both names a weight may come under are views into them: the per-expert names of a
checkpoint on disk (``mlp.experts.<e>.gate_proj.weight``) and the fused names of a trainer's state dict
(``mlp.experts.gate_up_proj``), so a weight update writes in place whichever it sends.

The arithmetic is transformers': router logits in the hidden dtype, softmax in float32 over all experts, top-k,
renormalised when norm_topk_prob, the weights cast back. How the chosen experts are applied depends on the step:

- loop (a prefill): tokens sorted by expert, one product per expert hit, as transformers does; its shapes
  depend on the routing, so it cannot be captured in a CUDA graph.
- grouped (any step, on a GPU where ``torch._grouped_mm`` runs): the (token, expert) pairs sorted by expert, one
  grouped product over all of them; fixed shapes (the group sizes are a device tensor).
- gathered (a decode step of few tokens, else): each pair's expert weights gathered, batched products.
- dense (a decode step of many tokens, else): every expert on every token, mixed with zero weights but for the
  k chosen; it reads each expert once where gathering would read it many times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MOE_TYPES = ("qwen2_moe", "qwen3_moe")

Act = Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up of a [..., 2I] product


@dataclass(frozen=True)
class MoeShape:
    """The experts of a model: how many, how many per token, their size, and which layers have them."""

    experts: int
    top_k: int
    intermediate: int  # of one expert
    norm_topk: bool  # renormalise the k chosen probabilities to sum to one
    shared: int  # the shared expert's intermediate size (Qwen2-MoE); 0: none
    sparse: tuple[bool, ...]  # per layer: experts, or a dense MLP of the config's intermediate_size

    @classmethod
    def of(cls, config) -> MoeShape | None:
        """None for a dense model."""
        if config.model_type not in MOE_TYPES:
            return None
        skip = set(config.mlp_only_layers or ())
        sparse = tuple(
            i not in skip and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
            for i in range(config.num_hidden_layers)
        )
        shared = config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else 0
        return cls(
            config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            bool(config.norm_topk_prob), shared, sparse,
        )  # fmt: skip


def layer_shapes(m: MoeShape, hidden: int) -> dict[str, tuple[int, ...]]:
    """The fused weights of one sparse layer, by their key in the decoder's params (after ``<layer>.``)."""
    e, i, s = m.experts, m.intermediate, m.shared
    shapes = {"router": (e, hidden), "experts_gate_up": (e, 2 * i, hidden), "experts_down": (e, hidden, i)}
    if s:
        shapes |= {"shared_gate_up": (2 * s, hidden), "shared_down": (hidden, s), "shared_gate": (1, hidden)}
    return shapes


def layer_views(
    m: MoeShape, p: dict[str, torch.Tensor], pre: str, mlp: str
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Hugging Face name -> view of one sparse layer's weights (``pre``: its params' prefix, ``mlp``: its HF
    prefix), and the fused names with the per-expert names each one covers (a load needs one or the other)."""
    gate_up, down = p[pre + "experts_gate_up"], p[pre + "experts_down"]
    views = {mlp + "gate.weight": p[pre + "router"]}
    covers: dict[str, list[str]] = {mlp + "experts.gate_up_proj": [], mlp + "experts.down_proj": []}
    for e in range(m.experts):
        at = f"{mlp}experts.{e}."
        views[at + "gate_proj.weight"], views[at + "up_proj.weight"] = gate_up[e].chunk(2)
        views[at + "down_proj.weight"] = down[e]
        covers[mlp + "experts.gate_up_proj"] += [at + "gate_proj.weight", at + "up_proj.weight"]
        covers[mlp + "experts.down_proj"].append(at + "down_proj.weight")
    views |= {mlp + "experts.gate_up_proj": gate_up, mlp + "experts.down_proj": down}
    if m.shared:
        at = mlp + "shared_expert."
        views[at + "gate_proj.weight"], views[at + "up_proj.weight"] = p[pre + "shared_gate_up"].chunk(2)
        views[at + "down_proj.weight"] = p[pre + "shared_down"]
        views[mlp + "shared_expert_gate.weight"] = p[pre + "shared_gate"]
    return views, covers


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts, most probable first, and their weights in h's dtype: [T, k] each."""
    probs = F.linear(h, router).softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), ids


# --- the ways to apply the experts: each takes h [T, H], ids and weights [T, k], and the fused weights ---------


def experts_loop(h, ids, weights, gate_up, down, act: Act) -> torch.Tensor:
    """One product per expert hit over its tokens, summed in expert order (transformers' order)."""
    k, out = ids.shape[1], torch.zeros_like(h)
    order = ids.flatten().argsort(stable=True)  # the (token, choice) pairs, grouped by expert
    counts = torch.bincount(ids.flatten(), minlength=gate_up.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start : start + n]
            tokens = pairs // k
            y = F.linear(act(F.linear(h[tokens], gate_up[e])), down[e])
            out.index_add_(0, tokens, y * weights.flatten()[pairs, None])
        start += n
    return out


def experts_gathered(h, ids, weights, gate_up, down, act: Act) -> torch.Tensor:
    """Each (token, choice) pair's expert weights gathered: two batched products of fixed shapes."""
    (t, k), flat = ids.shape, ids.flatten()
    x = h.repeat_interleave(k, dim=0)[:, None]  # [T*k, 1, H]
    y = act(torch.bmm(x, gate_up[flat].transpose(1, 2)))
    y = torch.bmm(y, down[flat].transpose(1, 2)).view(t, k, -1)
    return (y * weights[..., None]).sum(dim=1)


def experts_dense(h, ids, weights, gate_up, down, act: Act) -> torch.Tensor:
    """Every expert on every token, mixed by weights that are zero but for each token's k experts."""
    mix = torch.zeros(h.shape[0], gate_up.shape[0], device=h.device, dtype=h.dtype).scatter(1, ids, weights)
    y = act(torch.matmul(h, gate_up.transpose(1, 2)))  # [E, T, 2I] -> [E, T, I]
    y = torch.matmul(y, down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", y, mix)


def experts_grouped(h, ids, weights, gate_up, down, act: Act) -> torch.Tensor:
    """The pairs sorted by expert and multiplied by one grouped product each: fixed shapes, no host sync."""
    k, flat = ids.shape[1], ids.flatten()
    order = flat.argsort()
    counts = torch.zeros(gate_up.shape[0], device=h.device, dtype=torch.int32)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no bincount: it syncs on a GPU
    ends = counts.cumsum(0, dtype=torch.int32)
    tokens = order // k
    y = act(torch._grouped_mm(h[tokens], gate_up.transpose(1, 2), offs=ends))
    y = torch._grouped_mm(y, down.transpose(1, 2), offs=ends) * weights.flatten()[order, None]
    return torch.zeros_like(h).index_add_(0, tokens, y)


def grouped_works(device: torch.device, dtype: torch.dtype, m: MoeShape, hidden: int, act: Act) -> bool:
    """Whether torch's grouped product runs here for these shapes, agrees with the loop, and can be captured
    in a CUDA graph (some builds read the group sizes on the host for some dtypes); only GPUs are asked, as
    elsewhere the loop is as fast."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator(device).manual_seed(0)
        rand = lambda *size: torch.randn(*size, device=device, dtype=dtype, generator=gen) * 0.1  # noqa: E731
        h, router = rand(5, hidden), rand(m.experts, hidden)
        gate_up, down = rand(m.experts, 2 * m.intermediate, hidden), rand(m.experts, hidden, m.intermediate)
        weights, ids = route(h, router, m.top_k, m.norm_topk)
        expected = experts_loop(h, ids, weights, gate_up, down, act)
        experts_grouped(h, ids, weights, gate_up, down, act)  # warm up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = experts_grouped(h, ids, weights, gate_up, down, act)
        graph.replay()
        return torch.allclose(got, expected, atol=2e-2, rtol=2e-2)
    except Exception as exc:  # no kernel for this GPU, dtype or torch, or none a graph can hold: others serve
        log.warning("torch._grouped_mm is not usable here (%s): experts run by loop, gather or dense", exc)
        return False


class Experts:
    """The sparse layers' forward: routing, the chosen way to apply the experts, the shared expert."""

    def __init__(self, m: MoeShape, hidden: int, device: torch.device, dtype: torch.dtype, act: Act):
        self.m, self.act = m, act
        self.grouped = grouped_works(device, dtype, m, hidden, act)

    def apply(self, h, ids, weights, gate_up, down, static: bool) -> torch.Tensor:
        """The routed experts' sum; ``static``: fixed shapes and no host sync (a decode step, CUDA graphs)."""
        if self.grouped:
            way = experts_grouped
        elif not static:
            way = experts_loop
        else:  # gathering reads T*k experts' weights, the dense mixture all E of them once
            way = experts_gathered if ids.numel() < self.m.experts else experts_dense
        return way(h, ids, weights, gate_up, down, self.act)

    def forward(
        self, p: dict[str, torch.Tensor], pre: str, h: torch.Tensor, static: bool, record: torch.Tensor | None
    ) -> torch.Tensor:
        """The MLP output of sparse layer ``pre`` for h [T, H]; ``record`` [T, k] (int32) takes the experts
        chosen."""
        m = self.m
        weights, ids = route(h, p[pre + "router"], m.top_k, m.norm_topk)
        if record is not None:
            record.copy_(ids)
        out = self.apply(h, ids, weights, p[pre + "experts_gate_up"], p[pre + "experts_down"], static)
        if m.shared:
            shared = F.linear(self.act(F.linear(h, p[pre + "shared_gate_up"])), p[pre + "shared_down"])
            out = out + torch.sigmoid(F.linear(h, p[pre + "shared_gate"])) * shared
        return out
