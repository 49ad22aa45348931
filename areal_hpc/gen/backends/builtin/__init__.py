"""The built-in generation server: SGLang's HTTP API over a batched transformers model (CPU or one GPU)."""

from areal_hpc.gen.backends.builtin.server import start

__all__ = ["start"]
