"""HF <-> Megatron weights, shard by shard: which HF tensors make each parameter of one (TP rank, PP stage).

Megatron's layout, per decoder layer:
- ``linear_qkv``: q, k and v fused and grouped per KV head, ``[g0: q heads, k, v | g1: ... ]``, so that a
  TP rank's rows are whole groups;
- ``linear_fc1``: ``[gate; up]`` of this TP rank's columns;
- a mixture-of-experts layer (``moe_layer``): ``mlp.router.weight`` (HF ``mlp.gate``), whole on every rank; the
  experts of this expert-parallel rank stacked, ``mlp.experts.fc1_weight [E_local, 2I, H]`` (each expert's
  ``[gate; up]``) and ``fc2_weight [E_local, H, I]``, not split over TP (expert tensor size 1); Qwen2-MoE's
  shared expert as a dense MLP (``mlp.shared_experts``) with its sigmoid gate ``gate_weight [1, H]``;
- column-parallel layers (qkv, fc1) and the vocabulary (embedding, LM head) split rows over TP ranks, row-parallel
  layers (``linear_proj``, ``linear_fc2``) split columns; norms are whole on every rank;
- a stage holds ``num_layers / pp`` consecutive layers, named from 0 on the stage.
Tied embeddings: one stage holds the embedding and uses it as the LM head; with several stages the last one
has its own copy (``output_layer``) of the HF ``embed_tokens``.

Everything here is pure (tensors in, tensors out): the engine brings the tensors and gathers the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from areal_hpc.config import moe_experts


@dataclass(frozen=True)
class Layout:
    """Where one rank's shards sit: its TP rank of ``tp``, its PP stage of ``pp``, its expert-parallel rank of
    ``ep`` (which experts it holds)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1


@dataclass(frozen=True)
class Param:
    """One Megatron parameter: the HF tensors it is made of, how it splits over TP ranks."""

    hf_names: tuple[str, ...]
    kind: Literal["plain", "qkv", "fc1", "experts_fc1", "experts_fc2"] = "plain"
    split: int | None = None  # the TP dimension of a plain parameter; None: whole on every rank

    @property
    def tp_dim(self) -> int | None:
        """The dimension split over TP ranks (None: whole on every rank)."""
        if self.experts:
            return None
        return 0 if self.kind != "plain" else self.split

    @property
    def experts(self) -> bool:
        """Stacked experts: split over expert-parallel ranks (dimension 0), not over TP ranks."""
        return self.kind.startswith("experts")


def qkv_bias(hf: dict[str, Any]) -> bool:
    """Whether q, k and v have biases (Qwen2's always do)."""
    return hf["model_type"] in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias"))


def moe_layer(hf: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` is sparse (routed experts) rather than a dense MLP, as transformers'
    Qwen2-MoE and Qwen3-MoE decide it."""
    step = hf.get("decoder_sparse_step") or 1
    return moe_experts(hf) > 0 and layer not in (hf.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def local_experts(hf: dict[str, Any], layout: Layout) -> range:
    """The global indices of the experts this expert-parallel rank holds."""
    per_rank = moe_experts(hf) // layout.ep
    return range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank)


def stage_layers(n_layers: int, layout: Layout) -> range:
    """The global indices of the decoder layers on this stage."""
    per_stage = n_layers // layout.pp
    return range(layout.pp_rank * per_stage, (layout.pp_rank + 1) * per_stage)


def params_of(hf: dict[str, Any], layout: Layout) -> dict[str, Param]:
    """This stage's Megatron parameters by name, each with its HF sources (TP splits are the same on all ranks)."""
    tied = bool(hf.get("tie_word_embeddings"))
    out: dict[str, Param] = {}
    if layout.first:
        out["embedding.word_embeddings.weight"] = Param(("model.embed_tokens.weight",), split=0)
    for local, layer in enumerate(stage_layers(hf["num_hidden_layers"], layout)):
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = Param((h + "input_layernorm.weight",))
        out[m + "self_attention.linear_qkv.weight"] = Param(
            tuple(f"{attn}{x}_proj.weight" for x in "qkv"), kind="qkv"
        )
        if qkv_bias(hf):
            out[m + "self_attention.linear_qkv.bias"] = Param(
                tuple(f"{attn}{x}_proj.bias" for x in "qkv"), kind="qkv"
            )
        if hf["model_type"] in ("qwen3", "qwen3_moe"):
            out[m + "self_attention.q_layernorm.weight"] = Param((attn + "q_norm.weight",))
            out[m + "self_attention.k_layernorm.weight"] = Param((attn + "k_norm.weight",))
        out[m + "self_attention.linear_proj.weight"] = Param((attn + "o_proj.weight",), split=1)
        out[m + "pre_mlp_layernorm.weight"] = Param((h + "post_attention_layernorm.weight",))
        if moe_layer(hf, layer):
            out.update(_moe_params(hf, layout, m + "mlp.", h + "mlp."))
        else:
            out.update(_mlp_params(m + "mlp.", h + "mlp."))
    if layout.last:
        out["decoder.final_layernorm.weight"] = Param(("model.norm.weight",))
        if not tied:
            out["output_layer.weight"] = Param(("lm_head.weight",), split=0)
        elif not layout.first:  # the last stage's copy of the tied embedding
            out["output_layer.weight"] = Param(("model.embed_tokens.weight",), split=0)
    return out


def _mlp_params(m: str, h: str) -> dict[str, Param]:
    """A dense SwiGLU MLP: Megatron's names under ``m``, HF's under ``h``."""
    return {
        m + "linear_fc1.weight": Param((h + "gate_proj.weight", h + "up_proj.weight"), "fc1"),
        m + "linear_fc2.weight": Param((h + "down_proj.weight",), split=1),
    }


def _moe_params(hf: dict[str, Any], layout: Layout, m: str, h: str) -> dict[str, Param]:
    """A sparse layer: the router, this rank's experts, Qwen2-MoE's gated shared expert."""
    experts = [f"{h}experts.{e}." for e in local_experts(hf, layout)]
    out = {
        m + "router.weight": Param((h + "gate.weight",)),
        m + "experts.fc1_weight": Param(
            tuple(f"{x}{p}_proj.weight" for x in experts for p in ("gate", "up")), "experts_fc1"
        ),
        m + "experts.fc2_weight": Param(tuple(f"{x}down_proj.weight" for x in experts), "experts_fc2"),
    }
    if hf.get("shared_expert_intermediate_size"):
        out.update(_mlp_params(m + "shared_experts.", h + "shared_expert."))
        out[m + "shared_experts.gate_weight"] = Param((h + "shared_expert_gate.weight",))
    return out


def _groups(hf: dict[str, Any]) -> int:
    return hf.get("num_key_value_heads") or hf["num_attention_heads"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[q; k; v]`` (weights ``[rows, H]`` or biases ``[rows]``) regrouped per KV head."""
    q, k, v = (x.reshape(groups, -1, *x.shape[1:]) for x in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def split_qkv(fused: torch.Tensor, groups: int, n_heads: int) -> tuple[torch.Tensor, ...]:
    """The inverse of ``fuse_qkv``: ``(q, k, v)``, views of one new tensor filled by one foreach copy (no view
    of ``fused`` holds q: each group's k and v rows sit between two groups' q rows)."""
    per_group = fused.reshape(groups, -1, *fused.shape[1:])
    head = per_group.shape[1] // (n_heads // groups + 2)
    parts = per_group.split([per_group.shape[1] - 2 * head, head, head], dim=1)
    out = torch.empty_like(fused).split([groups * p.shape[1] for p in parts])
    torch._foreach_copy_([o.view(p.shape) for o, p in zip(out, parts, strict=True)], list(parts))
    return out


def shard(param: Param, tensors: Sequence[torch.Tensor], hf: dict[str, Any], layout: Layout) -> torch.Tensor:
    """This TP rank's shard of ``param`` from its full HF ``tensors`` (in ``param.hf_names`` order)."""
    tp, rank = layout.tp, layout.tp_rank
    if param.kind == "experts_fc1":  # (gate, up) of each expert in turn
        return torch.stack([torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)])
    if param.kind == "experts_fc2":
        return torch.stack(tensors)
    if param.kind == "qkv":
        return fuse_qkv(*tensors, _groups(hf)).chunk(tp)[rank]
    if param.kind == "fc1":
        gate, up = (x.chunk(tp)[rank] for x in tensors)
        return torch.cat([gate, up])
    (full,) = tensors
    return full if param.split is None else full.chunk(tp, dim=param.split)[rank]


def unshard(param: Param, shards: Sequence[torch.Tensor], hf: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The full HF tensors of ``param`` (in ``param.hf_names`` order) from its shards of every TP rank; with
    one shard, views of it (no copy)."""

    def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)

    if param.experts:  # the shards of the expert-parallel ranks, in rank order
        stacked = cat(shards)
        if param.kind == "experts_fc2":
            return tuple(stacked.unbind())
        return tuple(half for expert in stacked.unbind() for half in expert.chunk(2))
    if param.kind == "qkv":
        return split_qkv(cat(shards), _groups(hf), hf["num_attention_heads"])
    if param.kind == "fc1":
        halves = [s.chunk(2) for s in shards]
        return cat([g for g, _ in halves]), cat([u for _, u in halves])
    return (shards[0] if param.split is None else cat(shards, param.split),)


def load_shards(
    hf: dict[str, Any], layout: Layout, read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, Param, torch.Tensor]]:
    """This rank's Megatron parameters, one at a time, from ``read(hf_name)`` (a full HF tensor)."""
    for name, param in params_of(hf, layout).items():
        yield name, param, shard(param, [read(n) for n in param.hf_names], hf, layout)


def stream_shards(
    hf: dict[str, Any], layout: Layout, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, Param, torch.Tensor]]:
    """``load_shards`` from a stream of full HF tensors (another layout's weights: parameter reallocation). A
    parameter comes as soon as its last HF tensor has; a tensor is held only until every parameter that needs
    it came. The stream is drained to its end (it may be a collective)."""
    params = params_of(hf, layout)
    users: dict[str, list[str]] = {}  # HF name -> the parameters made of it
    for name, param in params.items():
        for hf_name in param.hf_names:
            users.setdefault(hf_name, []).append(name)
    left = {hf_name: len(names) for hf_name, names in users.items()}
    held: dict[str, torch.Tensor] = {}
    for hf_name, tensor in weights:
        if hf_name not in users:  # another stage's
            continue
        held[hf_name] = tensor
        for name in users[hf_name]:
            param = params[name]
            if all(n in held for n in param.hf_names):
                yield name, param, shard(param, [held[n] for n in param.hf_names], hf, layout)
                for n in param.hf_names:
                    left[n] -= 1
                    if not left[n]:
                        del held[n]


def exported(hf: dict[str, Any], layout: Layout) -> dict[str, Param]:
    """The parameters of ``params_of`` whose HF tensors this stage exports: each HF tensor once over all
    stages (a tied embedding by the first stage, not by the last one's copy); stacked experts with the names
    of every expert-parallel rank's (their shards are gathered over the expert-parallel group)."""
    return {
        name: param
        for name, param in params_of(hf, replace(layout, ep=1, ep_rank=0)).items()
        if not (name == "output_layer.weight" and param.hf_names == ("model.embed_tokens.weight",))
    }
