"""A megatron-core GPTModel from an HF config (Qwen2, Qwen3, LLaMA, Qwen2-MoE, Qwen3-MoE), on megatron-core's
local layer spec.

Three modules of the spec are ours:
- the core attention (``PackedAttention``): the rotary embedding of each token at its position in its sequence,
  then causal attention within each packed sequence (``train.packed``), where the local spec's
  DotProductAttention takes no packed sequences (Transformer Engine's does, and it is not installed). The
  model itself has no rotary module: Megatron's own applies a packed row's rotary embedding one sequence at a
  time (a split, kernels per sequence, a cat: 7% of a 3B step on an H200); here it is one fused kernel for q
  and one for k, from tables made once per micro-batch (``PackedRope``);
- the model's last stage returns the final hidden states (after the last norm), not logits: the LM head runs
  in ``train.head`` chunk by chunk over this rank's slice of the vocabulary, never as ``[T, V]`` logits;
- the routed experts of a sparse layer (``experts.GroupedExperts``), behind megatron-core's router (top-k,
  normalised as the HF model does), its all-to-all token dispatcher (dropless, tokens of any count per rank) and
  its load-balancing and z losses. With tensor parallelism, a MoE model runs sequence parallel (megatron-core
  requires it for training): each TP rank holds a slice of the tokens between the attention blocks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_hpc.config import megatron_model_problems
from areal_hpc.train.backends.megatron.convert import Layout, moe_experts, moe_layer, qkv_bias, stage_layers
from areal_hpc.train.backends.megatron.experts import GroupedExperts
from areal_hpc.train.head import kernel
from areal_hpc.train.packed import causal_varlen


def rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base of an HF config (transformers 5 keeps it in ``rope_parameters``)."""
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def moe_fields(hf: dict[str, Any], tp: int, ep: int, replay: bool = False) -> dict[str, Any]:
    """TransformerConfig's mixture-of-experts fields of the HF config ``hf`` (none for a dense model).

    - Routing: HF takes the softmax over all experts, then the top k, renormalised if ``norm_topk_prob``; the
      top k of the logits then a softmax over them (``pre_softmax`` False) is the same renormalised choice.
    - Losses: megatron-core's load-balancing loss (one per layer, summed) and z loss; ``moe.MoeStats`` sets their
      coefficients per step (its module says how they relate to HF's).
    """
    n_experts = moe_experts(hf)
    if not n_experts:
        return {}
    pattern = [int(moe_layer(hf, i)) for i in range(hf["num_hidden_layers"])]
    shared = hf.get("shared_expert_intermediate_size")
    return dict(
        num_moe_experts=n_experts,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_layer_freq=pattern,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="alltoall",  # takes micro-batches of any token count on each rank
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1,
        moe_enable_routing_replay=replay,  # each router gets a RouterReplay (train.backends.megatron.replay)
    )


def recompute_fields(recompute: bool, layers: int | None) -> dict[str, Any]:
    """Megatron's full recomputation: of every layer one by one, or of each stage's first ``layers``."""
    if not recompute or layers == 0:
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if layers is None:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": layers}


def transformer_config(
    hf: dict[str, Any],
    dtype: torch.dtype,
    tp: int = 1,
    pp: int = 1,
    recompute: bool = False,
    ep: int = 1,
    replay: bool = False,
    recompute_layers: int | None = None,
) -> TransformerConfig:
    """Megatron's config of the HF model ``hf`` (its config.json) at tensor size ``tp``, pipeline size ``pp`` and
    expert size ``ep``; with ``recompute``, the first ``recompute_layers`` layers of each stage recompute their
    activations (None: all).

    Parameters are created empty (the weights come from the HF checkpoint); fused kernels only on CUDA.
    """
    problems = megatron_model_problems(hf, tp, pp, ep)
    if problems:
        raise ValueError("; ".join(problems))
    cuda = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf),
        qk_layernorm=hf["model_type"] in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda,
        perform_initialization=False,
        bias_activation_fusion=False,  # the engine compiles the whole MLP on CUDA
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute_fields(recompute, recompute_layers),
        calculate_per_token_loss=True,  # our losses come normalised: Megatron must not divide them again
        **moe_fields(hf, tp, ep, replay),
    )
    # Every packed micro-batch has its own length: stages send their shapes first. Set after the checks,
    # which refuse it for the all-gather MoE dispatcher (not the all-to-all one used here).
    config.variable_seq_lengths = True
    return config


@dataclasses.dataclass
class PackedRope(PackedSeqParams):
    """Megatron's description of a packed micro-batch, with the rotary tables of its tokens: ``cos``, ``sin``
    ``[T, 1, head_dim]`` at each token's position in its sequence."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def rope_tables(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """``cos``, ``sin`` ``[T, 1, dim]`` of HF's rotary embedding (non-interleaved halves) at ``positions``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, dim]`` rotated as HF's ``apply_rotary_pos_emb`` does."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class PackedAttention(MegatronModule):
    """Core attention over packed sequences (``thd``): ``q [T, heads, dim]``, ``k``, ``v [T, groups, dim]`` of
    this TP rank -> ``[T, heads * dim]``, causal within each sequence of ``packed_seq_params``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout=None,
        softmax_scale: float | None = None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if not isinstance(packed_seq_params, PackedRope) or attention_bias is not None:
            raise NotImplementedError(
                "PackedAttention runs packed sequences (PackedRope) without an attention bias"
            )
        rope = kernel(apply_rope, query.device)
        p = packed_seq_params
        query, key = rope(query, p.cos, p.sin), rope(key, p.cos, p.sin)
        out = causal_varlen(query, key, value, p.cu_seqlens_q, p.max_seqlen_q, self.scale)
        return out.reshape(out.shape[0], -1)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built as megatron-core builds a norm, whose own wrapper refuses sequence parallelism: then
    each TP rank normalises its own tokens and the weight's gradient is summed over the TP ranks (Megatron's
    gradient reduction reads the ``sequence_parallel`` attribute)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(config: TransformerConfig, sparse: bool = False) -> ModuleSpec:
    """The local spec (SwiGLU, plain torch layers) with our ``RMSNorm`` and ``PackedAttention``; a sparse
    layer's MLP is megatron-core's MoE layer with ``GroupedExperts``."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    attention = spec.submodules.self_attention
    qk_norm = RMSNorm if config.qk_layernorm else attention.submodules.q_layernorm
    submodules = dataclasses.replace(
        attention.submodules, core_attention=PackedAttention, q_layernorm=qk_norm, k_layernorm=qk_norm
    )
    layer = dataclasses.replace(
        spec.submodules,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=dataclasses.replace(attention, submodules=submodules),
    )
    if sparse:
        moe = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
        experts = ModuleSpec(module=GroupedExperts)
        layer = dataclasses.replace(
            layer,
            mlp=dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, experts=experts)),
        )
    return dataclasses.replace(spec, submodules=layer)


def block_spec(hf: dict[str, Any], config: TransformerConfig, layout: Layout) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage, dense or sparse as the HF config says."""
    dense = layer_spec(config)
    sparse = layer_spec(config, sparse=True) if moe_experts(hf) else None
    layers = [sparse if moe_layer(hf, i) else dense for i in stage_layers(hf["num_hidden_layers"], layout)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


class HiddenGPT(GPTModel):
    """A GPTModel whose last stage returns the final hidden states ``[T, 1, H]`` instead of logits."""

    def _postprocess(self, hidden_states, **kwargs):
        return hidden_states


def build_model(
    hf: dict[str, Any], config: TransformerConfig, layout: Layout, groups: ProcessGroupCollection
) -> HiddenGPT:
    """This rank's part of the model at ``layout`` (the first stage embeds, the last holds the LM head),
    communicating over ``groups``."""
    return HiddenGPT(
        config,
        block_spec(hf, config, layout),
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=layout.first,
        post_process=layout.last,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
        position_embedding_type="none",  # PackedAttention applies the rotary embedding
        pg_collection=groups,
    )


def output_weight(model: HiddenGPT) -> torch.Tensor:
    """The last stage's LM-head weight, ``[V / tp, H]`` (the embedding's when they are tied on one stage)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
