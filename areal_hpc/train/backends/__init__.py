"""Training backends behind one seam: the engine that holds one model on a trainer rank.

A backend is a package (config/backends.py names it, by `actor.backend`, `ref.backend`, `critic.backend`) whose
`Engine(model_cfg, total_train_steps, seed, critic=...)` is a `TrainEngine`. The model function calls
(`train.interfaces`), the request handlers (`train.worker`) and weight publication use nothing else of it.

    fsdp      parameters, gradients and optimizer state sharded over the data-parallel ranks (the default);
              Ulysses sequence parallelism (Engine(..., context=))
    torch     the whole model on every rank, gradients summed over the data-parallel ranks
    megatron  megatron-core: tensor, pipeline, expert and data parallel
              (Engine(..., tensor=, pipeline=, expert=))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from areal_hpc.alloc import ParallelSpec
from areal_hpc.config import TRAIN_BACKENDS, MicroBatchSpec, ModelConfig
from areal_hpc.train.numerics import LossFn


class TrainEngine(Protocol):
    """One model (a causal LM, or a value model) on this rank; with an optimizer when it trains."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype, also that of published weights
    trainable: bool
    # The ranks holding other data (a minibatch's normaliser and statistics are reduced over them); None: all
    # ranks. With tensor, pipeline or context parallelism, the ranks of one replica hold the same data.
    dp_group: Any

    def logprobs(
        self, batch: Mapping[str, np.ndarray], temperature: float, mb_spec: MicroBatchSpec
    ) -> torch.Tensor:
        """Token-aligned float32 logprobs of the packed batch (0 at each sequence's first token)."""

    def values(self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec) -> torch.Tensor:
        """A value model's float32 value of each prefix."""

    def train_minibatch(
        self,
        micro_batches: Sequence[Mapping[str, np.ndarray]],
        loss_fn: LossFn,
        temperature: float = 1.0,
        skip: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over the ranks' micro-batches (the model's logits divided by `temperature`);
        `loss`, `grad_norm`, `lr`. `skip` is asked on every rank once every micro-batch's loss is known (it may
        be a collective): True leaves the weights and the optimizer's state as they were (the LR schedule
        advances, as for a non-finite gradient)."""

    def release_memory(self) -> None:
        """Between train steps, when colocated servers take the GPU: free the device buffers the next step
        remakes (gradient buffers); the trainer then empties the process's allocator cache."""

    def save_hf(self, path: str | Path) -> Path | None:
        """The model as an HF directory with a manifest (a collective; rank 0 returns the path)."""

    def hf_params(self) -> Mapping[str, torch.Tensor]:
        """The weights under their HF names as held (shards of a sharded engine): shapes and dtypes."""

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights under their HF names, one at a time, for publication and HF saves (a collective
        for a sharded engine: every rank drains it)."""

    def state_dict(self) -> dict[str, Any]:
        """The tensors a recover checkpoint keeps of this rank (weights, optimizer state), by parameter name."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def schedule_state(self) -> dict[str, Any]:
        """The LR schedule's state (JSON)."""

    def load_schedule_state(self, state: Mapping[str, Any]) -> None: ...


def make_engine(
    model_cfg: ModelConfig,
    total_train_steps: int | None = None,
    seed: int = 1,
    *,
    critic: bool = False,
    spec: ParallelSpec | None = None,
) -> TrainEngine:
    """The engine of `model_cfg.backend`; `total_train_steps` None: inference only. A backend with tensor or
    pipeline parallelism gets their sizes from `spec` (the trainer's layout; None: 1 and 1), and one with
    expert or context parallelism those sizes too."""
    backend = TRAIN_BACKENDS[model_cfg.backend]
    module = importlib.import_module(backend.module)
    kwargs = {}
    if spec is not None and (backend.tensor_parallel or backend.pipeline_parallel):
        kwargs = {"tensor": spec.tensor, "pipeline": spec.pipeline}
    if spec is not None and backend.expert_parallel:
        kwargs["expert"] = spec.expert
    if spec is not None and backend.context_parallel:
        kwargs["context"] = spec.context
    return module.Engine(model_cfg, total_train_steps, seed, critic=critic, **kwargs)
