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


TRAIN_BACKENDS = {
    "fsdp": Backend("areal_hpc.train.backends.fsdp", optimizer_offload=True),
    "torch": Backend("areal_hpc.train.backends.torch"),  # replicated: the baseline of bench_train
}
GEN_BACKENDS = {
    "builtin": Backend("areal_hpc.gen.backends.builtin"),
}
