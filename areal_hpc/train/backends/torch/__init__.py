"""The torch backend: the whole model on every rank, gradients summed over the data-parallel ranks."""

from areal_hpc.train.backends.torch.engine import TorchEngine as Engine

__all__ = ["Engine"]
