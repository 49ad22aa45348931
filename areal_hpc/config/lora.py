"""The options of a LoRA actor (actor.lora) against the rest of a config: where it trains, and what its
adapters' publication (weight_update_mode adapter) asks of the generation servers."""

from __future__ import annotations

from areal_hpc.config.backends import TRAIN_BACKENDS
from areal_hpc.config.schema import ExperimentConfig

# The linear layers of a decoder block: PEFT's all-linear on the dense models both servers run, each a name
# SGLang's --lora-target-modules takes (utils/common.py) and the built-in engine adapts (lora.py).
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def server_targets(cfg: ExperimentConfig) -> tuple[str, ...]:
    """The modules the servers make room for (--lora-target-modules); () when they serve no adapters."""
    if cfg.weight_update_mode != "adapter":
        return ()
    targets = cfg.actor.lora.target_modules
    return LINEAR if list(targets) == ["all-linear"] else tuple(targets)


def lora_problems(cfg: ExperimentConfig) -> list[str]:
    lora, out = cfg.actor.lora, []
    if lora.rank and not TRAIN_BACKENDS[cfg.actor.backend].lora:
        able = [b for b, spec in TRAIN_BACKENDS.items() if spec.lora]
        out.append(
            f"'actor.lora.rank' {lora.rank}: LoRA trains on the {', '.join(able)} backend; "
            f"'actor.backend' is {cfg.actor.backend!r}"
        )
    if cfg.weight_update_mode == "adapter":
        if not lora.rank:
            out.append(
                "'weight_update_mode' adapter publishes the actor's LoRA adapters, and 'actor.lora.rank' is 0 "
                "(full weights): set actor.lora.rank (e.g. 64), or give weight_update_mode=broadcast"
            )
        odd = sorted(set(server_targets(cfg)) - set(LINEAR))
        if odd:
            out.append(
                f"'actor.lora.target_modules': the generation servers adapt {', '.join(LINEAR)} "
                f"(or all-linear), not {', '.join(odd)}; weight_update_mode=broadcast publishes any adapter merged"
            )
    return out
