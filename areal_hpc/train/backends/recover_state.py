"""What a recover checkpoint keeps of an engine, in the two forms the trainer writes: tensors by parameter name
(model weights and optimizer state, for the sharded writer ``train.sharded``) and JSON (the LR schedule).

Every engine has them through ``RecoverState``: ``torch.distributed.checkpoint.state_dict`` names the state by parameter name for a
plain module and for an FSDP-sharded one alike, so a checkpoint loads into either layout and any rank count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def _aliases(model_state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Names of tensors that are an earlier name's tensor (a tied LM head) -> that earlier name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model_state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if not local.numel():
            continue
        key = local.untyped_storage().data_ptr()
        if key in first:
            aliases[name] = first[key]
        first.setdefault(key, name)
    return aliases


def tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, keep=None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: tensors (shards for a sharded model) only, by parameter name; a
    tied weight once; with ``keep`` (name -> bool), only the weights it keeps (a LoRA actor's adapters: its
    base never changes and is loaded from its path)."""
    model_state = get_model_state_dict(model)
    aliases = _aliases(model_state)
    kept = {k: v for k, v in model_state.items() if k not in aliases and (keep is None or keep(k))}
    state: dict[str, Any] = {"model": kept}
    if optimizer is not None:  # its param_groups (hyperparameters, no tensors) are rebuilt, not saved
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)["state"]
    return state


def load_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any], keep=None
) -> None:
    model_state = dict(state["model"])
    current = get_model_state_dict(model)
    for alias, name in _aliases(current).items():
        if name in model_state:
            model_state[alias] = model_state[name]
    if keep is not None:  # the weights not kept stay as loaded; every kept one must be there
        missing = sorted(k for k in current if keep(k) and k not in model_state)
        if missing:
            raise KeyError(
                f"the recover checkpoint lacks {len(missing)} adapter weight(s), e.g. {missing[0]}"
            )
    options = StateDictOptions(strict=keep is None)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and "optimizer" in state:
        groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
        set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": groups})


def schedule(optimizer: torch.optim.Optimizer | None, scheduler) -> dict[str, Any]:
    """The LR schedule's position and each group's current rate (JSON)."""
    if optimizer is None:
        return {}
    return {"scheduler": scheduler.state_dict(), "lrs": [g["lr"] for g in optimizer.param_groups]}


def load_schedule(optimizer: torch.optim.Optimizer | None, scheduler, state: dict[str, Any]) -> None:
    if optimizer is None or not state:
        return
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, state["lrs"], strict=True):
        group["lr"] = lr


class RecoverState:
    """The recover-state methods of a ``TrainEngine`` whose ``module``, ``optimizer`` and ``scheduler`` are
    attributes (``module``: what the optimizer's parameters belong to)."""

    module: nn.Module  # a property of each engine
    optimizer: torch.optim.Optimizer | None
    scheduler: Any

    recover_only = None  # name -> whether a recover checkpoint keeps that weight (None: all)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state (tensors, shards for a sharded engine, by parameter name)."""
        return tensors(self.module, self.optimizer, self.recover_only)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_tensors(self.module, self.optimizer, state, self.recover_only)

    def schedule_state(self) -> dict[str, Any]:
        return schedule(self.optimizer, self.scheduler)

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        load_schedule(self.optimizer, self.scheduler, state)
