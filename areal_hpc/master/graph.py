"""The dataflow graph of model function calls (MFCs), derived from the keys each call reads and writes.

The table is REFERENCE.md section 3; edges are derived (a call depends on the producer of each key it
reads) and the config prunes calls: disable_value removes the critic, kl_ctl == 0 removes ref_inf,
teacher_inf (the teacher's logprobs of on-policy distillation) exists only with distill_coef > 0, and
actor_inf exists only with recompute_logprob or use_decoupled_loss, and not when prox_logp_method loglinear
approximates its proximal logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_hpc.config import ExperimentConfig

# Keys a step's prompts bring before any call runs.
DATASET_KEYS = ("packed_prompts", "task_ids")
# Keys the rollout writes for some episodes or runs only (the weight version of each sampled token: multi-turn
# episodes; each token's routed experts: actor.router_replay rollout); a call reads them where every sample of its
# batch has them and does not wait for them.
OPTIONAL_KEYS = ("token_versions", "packed_routed_experts")


@dataclass(frozen=True)
class MFC:
    """One model function call: which model, which kind of call, which keys in and out."""

    name: str
    model: str
    kind: str  # generate | inference | train_step
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


_TRAIN_INPUTS = (
    "packed_input_ids",
    "packed_logprobs",
    "packed_ref_logprobs",
    "rewards",
    "success",
    "values",
    "prompt_mask",
    "seq_no_eos_mask",
    "group_ids",
    "proximal_logprobs",
    "version_start",
    "version_end",
    "token_versions",
)
_ACTOR_TRAIN_INPUTS = ("task_ids", "packed_teacher_logprobs", *_TRAIN_INPUTS, "packed_routed_experts")

ALL_MFCS = (
    MFC(
        "actor_gen",
        "actor",
        "generate",
        ("packed_prompts", "task_ids"),
        (
            "packed_input_ids",
            "packed_logprobs",
            "seq_no_eos_mask",
            "prompt_mask",
            "group_ids",
            "version_start",
            "version_end",
            "token_versions",
            "packed_routed_experts",
        ),
    ),
    MFC(
        "rew_inf",
        "reward",
        "inference",
        ("packed_input_ids", "packed_prompts", "task_ids"),
        ("rewards", "success"),
    ),
    MFC("ref_inf", "ref", "inference", ("packed_input_ids",), ("packed_ref_logprobs",)),
    MFC("teacher_inf", "teacher", "inference", ("packed_input_ids",), ("packed_teacher_logprobs",)),
    MFC(
        "actor_inf",
        "actor",
        "inference",
        ("packed_input_ids", "packed_routed_experts"),
        ("proximal_logprobs",),
    ),
    MFC("critic_inf", "critic", "inference", ("packed_input_ids", "seq_no_eos_mask"), ("values",)),
    MFC("actor_train", "actor", "train_step", _ACTOR_TRAIN_INPUTS, ()),
    MFC("critic_train", "critic", "train_step", _TRAIN_INPUTS, ()),
)
ROLLOUT_MFCS = ("actor_gen", "rew_inf")  # run by the rollout side, not by trainer ranks
# The one call of a supervised warm-up (experiment_type: sft).
SFT_TRAIN = MFC("sft_train", "actor", "train_step", ("packed_input_ids", "prompt_mask"), ())


def awaited(mfc: MFC) -> MFC:
    """The call as the buffer sees it: only the inputs it must wait for, without the optional ones."""
    return replace(mfc, inputs=tuple(k for k in mfc.inputs if k not in OPTIONAL_KEYS))


def kept_mfcs(cfg: ExperimentConfig) -> list[str]:
    """Names of the calls that the config keeps."""
    ppo = cfg.ppo
    dropped = set()
    if ppo.disable_value:
        dropped |= {"critic_inf", "critic_train"}
    if ppo.kl_ctl == 0:
        dropped.add("ref_inf")
    if not ppo.distill_coef > 0:
        dropped.add("teacher_inf")
    if not (ppo.recompute_logprob or ppo.use_decoupled_loss) or ppo.prox_logp_method == "loglinear":
        dropped.add("actor_inf")
    return [m.name for m in ALL_MFCS if m.name not in dropped]


def build_graph(cfg: ExperimentConfig, trainer_only: bool = False) -> list[MFC]:
    """The kept calls in dependency order, each reading only keys that some kept call or the dataset makes.

    `trainer_only` leaves out generation and reward, which the rollout side runs.
    """
    if cfg.experiment_type == "sft":
        return [SFT_TRAIN]
    names = kept_mfcs(cfg)
    produced = set(DATASET_KEYS)
    for mfc in ALL_MFCS:
        if mfc.name in names:
            produced.update(mfc.outputs)
    kept = [
        MFC(m.name, m.model, m.kind, tuple(k for k in m.inputs if k in produced), m.outputs)
        for m in ALL_MFCS
        if m.name in names
    ]
    ordered = topological_order(kept)
    return [m for m in ordered if not (trainer_only and m.name in ROLLOUT_MFCS)]


def dependencies(mfcs: list[MFC]) -> dict[str, set[str]]:
    """For each call, the calls that produce the keys it reads."""
    producer = {key: m.name for m in mfcs for key in m.outputs}
    return {m.name: {producer[k] for k in m.inputs if k in producer} for m in mfcs}


def topological_order(mfcs: list[MFC]) -> list[MFC]:
    """Calls ordered so that each comes after its producers (table order among equals)."""
    deps = dependencies(mfcs)
    done: list[str] = []
    while len(done) < len(mfcs):
        ready = [m.name for m in mfcs if m.name not in done and deps[m.name] <= set(done)]
        if not ready:
            cycle = sorted(set(deps) - set(done))
            raise ValueError(f"the dataflow graph has a cycle among {cycle}")
        done.append(ready[0])
    by_name = {m.name: m for m in mfcs}
    return [by_name[name] for name in done]
