"""LoRA adapters on a trained HF model (``actor.lora``), through PEFT: injected in place, so that the model keeps
its HF structure (``model.layers.N...``) and only the adapters train.

PEFT renames what it wraps: a target module's weight becomes ``<module>.base_layer.weight`` beside
``<module>.lora_A.default.weight`` and ``<module>.lora_B.default.weight``. ``adapter_of`` takes the adapters out
under their HF module names (``weights/adapter.py``'s ``Adapter``); what leaves the trainer as HF weights goes
through ``weights.merged``: the base names (``hf_name``), each target weight with its adapter added,
W + (alpha / r) B A, which is the policy the trainer computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from areal_hpc.weights import Adapter

ADAPTER = "default"  # PEFT's name of the one adapter
BASE, LORA_A, LORA_B = ".base_layer.", f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


def add_adapters(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str]) -> nn.Module:
    """`model` with LoRA adapters on `targets` (module names, or "all-linear": every linear layer but the LM
    head); only the adapters require gradients. PEFT starts B at zero: the model computes what it did."""
    from peft import LoraConfig, inject_adapter_in_model

    target = targets[0] if targets == ["all-linear"] else targets
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target, bias="none")
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name):  # float32 masters, whatever the base's dtype
            param.data = param.data.float()
    if not any(is_adapter(name) for name, _ in model.named_parameters()):
        raise ValueError(f"actor.lora.target_modules {targets} names no module of the model")
    return model


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """`model` computes its base (the reference policy of a LoRA actor: no second copy of the weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_of(named: Iterable[tuple[str, torch.Tensor]], rank: int, alpha: float, base: str) -> Adapter:
    """The adapter (``weights/adapter.py``) among an adapted model's named full tensors."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if is_adapter(name):
            half = "A" if LORA_A in name else "B"
            pairs.setdefault(name.split(LORA_A if half == "A" else LORA_B)[0], {})[half] = tensor
    return Adapter(rank, alpha, base, {m: (ab["A"], ab["B"]) for m, ab in pairs.items()})


def is_adapter(name: str) -> bool:
    return LORA_A in name or LORA_B in name


def hf_name(name: str) -> str:
    """The HF name of a base parameter (PEFT's ``base_layer`` removed)."""
    return name.replace(BASE, ".")
