"""The KV cache: one pool of pages of ``PAGE`` token positions shared by every row, per layer K and V tensors
[pages, PAGE, Hkv, D].

A row's keys and values live in the pages its block table lists (``pages.py`` says which row holds which),
so a row takes memory as it grows, not a slot sized for the longest answer: a long-tailed batch of answers
fits as many rows as their actual lengths allow. The pool's size is fixed when it is taken, from a share of
the device's memory, as SGLang's ``mem_fraction_static`` sizes its pool. Separate tensors per layer, not views
of one buffer: torch.compile and CUDA graphs then see plain inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from areal_hpc.gen.backends.builtin.model import Shape
from areal_hpc.gen.backends.builtin.paged_decode import PAGE

RESERVED_BYTES = 3 << 30  # left free on a GPU for the forward's activations (a prefill chunk) and CUDA graphs


@dataclass(frozen=True)
class Plan:
    """What the pool holds: its pages and what they come to."""

    pages: int  # page 0 included (the scratch page free rows point at)
    bytes_per_token: int
    context_len: int

    @property
    def tokens(self) -> int:
        """Positions rows can use (the scratch page is not theirs)."""
        return (self.pages - 1) * PAGE

    @property
    def gib(self) -> float:
        return self.pages * PAGE * self.bytes_per_token / 2**30

    @property
    def rows_at_full_context(self) -> int:
        return self.tokens // self.context_len

    def describe(self) -> dict:
        """/server_info's and the start log's account of the pool."""
        return {
            "pool_tokens": self.tokens,
            "pool_gib": round(self.gib, 3),
            "page_size": PAGE,
            "rows_at_full_context": self.rows_at_full_context,
        }


def budget_bytes(device: torch.device, mem_fraction: float, weights_bytes: int) -> int:
    """Bytes the pool may take: the server's share of the device less its weights (and, on a GPU, what the
    forward passes and graphs need); on a CPU untouched pages of a tensor cost nothing, so the share of the
    host's memory is a ceiling, not a reservation."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return min(int(mem_fraction * total) - weights_bytes, free) - RESERVED_BYTES
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(mem_fraction * host) - weights_bytes


def plan(
    shape: Shape, dtype: torch.dtype, budget: int, context_len: int, max_tokens: int | None = None
) -> Plan:
    """The pool ``budget`` bytes hold (at most ``max_tokens`` positions: a CPU needs no more than its rows can
    use); MemoryError when it cannot hold a single page."""
    per_token = shape.kv_bytes_per_token * dtype.itemsize
    pages = max(budget, 0) // (PAGE * per_token)
    if max_tokens is not None:
        pages = min(pages, -(-max_tokens // PAGE) + 1)
    if pages < 2:
        raise MemoryError(
            f"the KV cache gets {max(budget, 0) / 2**30:.2f} GiB, less than one page of {PAGE} positions "
            f"({PAGE * per_token / 2**20:.1f} MiB): raise sglang.mem_fraction_static"
        )
    return Plan(pages, per_token, context_len)


class KVCache:
    """Per-layer K and V pages; ``release`` gives the memory back and ``allocate`` takes it again."""

    def __init__(self, shape: Shape, pages: int, device: torch.device, dtype: torch.dtype):
        self.shape, self.pages, self.device, self.dtype = shape, pages, device, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        size = (self.pages, PAGE, self.shape.kv_heads, self.shape.head_dim)
        # Unwritten positions are never read, but the scratch page is, by free rows: zeros, not NaN bits.
        new = lambda: torch.empty(size, device=self.device, dtype=self.dtype).index_fill_(0, zero, 0)  # noqa: E731
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.k = [new() for _ in range(self.shape.layers)]
        self.v = [new() for _ in range(self.shape.layers)]

    def release(self) -> None:
        self.k, self.v = [], []

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as [positions, Hkv, D]: position p of page g is row g * PAGE + p."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
