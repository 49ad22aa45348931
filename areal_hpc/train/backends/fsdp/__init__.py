"""The FSDP2 backend: parameters, gradients and optimizer state sharded over the data-parallel ranks."""

from areal_hpc.train.backends.fsdp.engine import FSDPEngine as Engine

__all__ = ["Engine"]
