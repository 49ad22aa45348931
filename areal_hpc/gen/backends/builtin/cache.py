"""The KV cache: one static row ("slot") per running sample, per layer K and V tensors [slots, slot_len, Hkv, D].

A slot holds its sample's keys and values at positions 0..length-1; a decode step writes one position per slot
and attends over each slot's own length, so nothing is copied as rows come and go. Its size is fixed when it
is taken: ``slot_len`` from a share of the device's memory, as SGLang's ``mem_fraction_static`` sizes its pool.
Separate tensors per layer, not views of one buffer: torch.compile and CUDA graphs then see plain inputs.
"""

from __future__ import annotations

import os

import torch

from areal_hpc.gen.backends.builtin.model import Shape

RESERVED_BYTES = 3 << 30  # left free on a GPU for the forward's activations (a prefill chunk) and CUDA graphs
MIN_SLOT_LEN = 64
SLOT_ALIGN = 16


def slot_len(
    shape: Shape, slots: int, dtype: torch.dtype, device: torch.device, mem_fraction: float,
    context_len: int, weights_bytes: int,
) -> int:  # fmt: skip
    """Positions per slot: the context length, or what the memory left allows for ``slots`` slots."""
    per_token = shape.kv_bytes_per_token * dtype.itemsize
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(int(mem_fraction * total) - weights_bytes, free) - RESERVED_BYTES
    else:  # untouched pages of a CPU tensor cost nothing: the share is a ceiling, not a reservation
        budget = int(mem_fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) - weights_bytes
    length = min(context_len, max(budget, 0) // (slots * per_token)) // SLOT_ALIGN * SLOT_ALIGN
    if length < MIN_SLOT_LEN:
        raise MemoryError(
            f"the KV cache of {slots} slots fits {length} positions each ({max(budget, 0) / 2**30:.1f} GiB for it): "
            f"lower max_running_requests or raise sglang.mem_fraction_static"
        )
    return length


class KVCache:
    """Per-layer K and V of every slot; ``release`` gives the memory back and ``allocate`` takes it again."""

    def __init__(self, shape: Shape, slots: int, length: int, device: torch.device, dtype: torch.dtype):
        self.shape, self.slots, self.length, self.device, self.dtype = shape, slots, length, device, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        size = (self.slots, self.length, self.shape.kv_heads, self.shape.head_dim)
        new = lambda: torch.empty(size, device=self.device, dtype=self.dtype)  # noqa: E731
        self.k = [new() for _ in range(self.shape.layers)]
        self.v = [new() for _ in range(self.shape.layers)]

    def release(self) -> None:
        self.k, self.v = [], []

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions to slot ``dst`` (compacting running rows)."""
        for t in self.k + self.v:
            t[dst, :length] = t[src, :length]
