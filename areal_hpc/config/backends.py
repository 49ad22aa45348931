"""The backends a run can name, what each can do, and where its code lives.

A training backend (`actor.backend`, `ref.backend`, `critic.backend`) builds the model engines of a trainer rank;
a generation backend (the name before the '.' of allocation_mode's generation part) starts the generation
servers. Validation reads the capabilities below, so that a layout a backend cannot run is refused before
anything is written or submitted. Adding a backend is its folder (`module`) and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    module: str  # the package that implements it, imported by the stage that runs it
    tensor_parallel: bool = False
    pipeline_parallel: bool = False
    optimizer_offload: bool = False  # optimizer state kept in CPU memory (optimizer.offload)
    expert_parallel: bool = False  # an MoE model's experts split over e ranks (allocation_mode's e)
    router_replay: bool = (
        False  # routes an MoE model's tokens as the generation servers did (actor.router_replay)
    )
    value_model: bool = True  # can host the critic
    lora: bool = False  # trains LoRA adapters (actor.lora)
    context_parallel: bool = False  # one sequence's tokens split over c ranks (allocation_mode's c)
    # Generation: each of a request's n answers drawn from its own stream of `sampling_seed`. SGLang ignores
    # the seed unless launched deterministic, and then gives all n answers the same one (n identical answers).
    seeded_sampling: bool = False


TRAIN_BACKENDS = {
    "fsdp": Backend(
        "areal_hpc.train.backends.fsdp", optimizer_offload=True, lora=True, context_parallel=True
    ),
    "torch": Backend("areal_hpc.train.backends.torch"),  # replicated: the baseline of bench_train
    # Issue 13 in progress: no value model yet. No context parallelism: megatron-core's needs Transformer
    # Engine's attention, which this project does not install (checks._context_problem).
    "megatron": Backend(
        "areal_hpc.train.backends.megatron",
        tensor_parallel=True,
        pipeline_parallel=True,
        expert_parallel=True,
        router_replay=True,
        value_model=False,
    ),
}
GEN_BACKENDS = {
    "builtin": Backend("areal_hpc.gen.backends.builtin", seeded_sampling=True),
    "sglang": Backend("areal_hpc.gen.backends.sglang", tensor_parallel=True),  # the `sglang` extra
}

# the HF models the megatron backend builds: dense, and mixture-of-experts
MEGATRON_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")


def moe_experts(hf: dict) -> int:
    """The routed experts of the HF model of config.json ``hf``; 0 for a dense model. Hub configs of Qwen2-MoE
    and Qwen3-MoE call them num_experts; transformers 5 saves them as num_local_experts."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def megatron_model_problems(hf: dict, tp: int = 1, pp: int = 1, ep: int = 1) -> list[str]:
    """What keeps the HF model of config.json ``hf`` from the megatron backend at tensor size ``tp``, pipeline
    size ``pp`` and expert size ``ep`` (attention heads against ``tp`` are alloc.check_model_heads' to
    judge)."""
    kind = hf.get("model_type")
    if kind not in MEGATRON_MODEL_TYPES:
        return [
            f"model_type {kind!r} is not one the megatron backend builds ({', '.join(MEGATRON_MODEL_TYPES)})"
        ]
    out = []
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {hf['hidden_act']!r}: the megatron backend builds SwiGLU (silu) MLPs")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        out.append(f"rope_type {rope_type!r}: the megatron backend has plain rotary embeddings only")
    if hf.get("use_sliding_window") or hf.get("mlp_bias"):
        out.append("sliding-window attention and MLP biases are not built by the megatron backend")
    if hf["num_hidden_layers"] % pp:
        out.append(f"{hf['num_hidden_layers']} layers do not split evenly into {pp} pipeline stages")
    if hf["vocab_size"] % tp:
        out.append(f"the vocabulary ({hf['vocab_size']}) does not split evenly over tensor size {tp}")
    experts = moe_experts(hf)
    if ep > 1 and not experts:
        out.append(f"e{ep} needs a mixture-of-experts model; {kind} is dense")
    elif experts % ep:
        out.append(f"{experts} experts do not split evenly over expert size {ep}")
    return out
