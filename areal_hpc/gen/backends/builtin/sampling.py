"""Next-token sampling on the device, per slot: temperature, top-p, top-k, banned stop tokens and a seeded draw.

Each slot keeps its sample's settings in device tensors, so a decode step samples with no host round trip. The
random number of a sample's k-th token is a hash of (its seed, k) only, the same on every device, and a row's
draw reads only its own logits and settings (its bans included). Its logits are not batch-independent: matrix
products and attention choose their kernels, hence their summation order, by batch size and span (bf16 GEMM
tiling on a GPU; float32 on CPU too: one sample alone and beside 11 rows had logprobs up to 5e-7 apart), so a
draw whose uniform falls that close to a step of the CDF can change. A sample is batch-independent only where
its logits are bit-identical; elsewhere its tokens nearly always are, and its distribution is.

The logprob returned for a token is ``log_softmax(logits / temperature)`` of that token over the WHOLE vocabulary
(``log_softmax(logits)`` when greedy): top-k, top-p and the min_new_tokens ban only restrict which tokens may be
drawn. That is what a trainer recomputes, as SGLang reports.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU CI has no triton: block_stats runs in torch there
    triton = None

from areal_hpc.gen.backends.builtin.protocol import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # at or below: greedy (SGLang treats tiny temperatures the same way)
BLOCK = 256  # tokens per block of the two-level draw


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (wrapping int64 arithmetic)."""
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per (seed, counter): the counter-th output of splitmix64 seeded with the mixed seed.
    The seed is mixed first: seeds s and s + 1 (a request's n samples) must not give shifted copies of one
    stream."""
    x = _mix(_mix(seeds) + (counters + 1) * _GOLDEN)
    return _shift(x, 11).double() / float(1 << 53)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k and top-p nucleus (top_k >= vocab, top_p 1: no-op)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    probs = sorted_logits.softmax(dim=-1)
    # A token is kept while the probability mass BEFORE it is below top_p, so the most likely token always is.
    drop = (ranks[None, :] >= top_k[:, None]) | (probs.cumsum(dim=-1) - probs > top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Scaled(NamedTuple):
    """A batch's logits as a draw sees them, never written: ``logits * scale[:, None]`` in float32, with the
    ``stops`` [R, k] of ``banned`` rows at -inf (each row's ids sorted, its padding repeating its last id)."""

    logits: torch.Tensor  # [R, V], any float dtype
    scale: torch.Tensor  # [R] float32
    stops: torch.Tensor  # [R, k] token ids, each row non-decreasing
    banned: torch.Tensor  # [R] bool

    @classmethod
    def of(cls, logits: torch.Tensor) -> Scaled:
        """The logits as they are: scale 1, nothing banned."""
        ones, zeros = logits.new_ones, logits.new_zeros
        rows = logits.shape[0]
        return cls(
            logits,
            ones(rows, dtype=torch.float32),
            zeros(rows, 1, dtype=torch.long),
            zeros(rows, dtype=torch.bool),
        )

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """The values at ``index`` [R, n]."""
        x = self.logits.gather(1, index).float() * self.scale[:, None]
        # A search of the sorted stops, where comparing with each would take [R, n, k] (k up to 1024).
        at = torch.searchsorted(self.stops, index).clamp_(max=self.stops.shape[1] - 1)
        hit = (self.stops.gather(1, at) == index) & self.banned[:, None]
        return x.masked_fill_(hit, float("-inf"))

    def dense(self) -> torch.Tensor:
        """All the values, [R, V] float32."""
        x = self.logits.float() * self.scale[:, None]
        ban = torch.where(self.banned[:, None], float("-inf"), x.gather(1, self.stops))
        return x.scatter_(1, self.stops, ban)  # padding writes its row's last stop id again: the same value


class Blocks(NamedTuple):
    """Per block of ``BLOCK`` tokens of a row's ``Scaled`` values x: max, sum of exp(x - max) (0 when every x
    is -inf) and the first token of the max (a vocabulary index); each [R, blocks]."""

    max: torch.Tensor
    sum: torch.Tensor
    arg: torch.Tensor


def block_stats(scaled: Scaled) -> Blocks:
    """The ``Blocks`` of ``scaled``: on a GPU one Triton pass that reads the logits once, where torch's way
    writes and reads [R, V] float32 temporaries (~0.5 ms a step at 128 rows of a 152k vocabulary)."""
    if triton is not None and scaled.logits.is_cuda:
        return _block_stats_triton(scaled)
    rows, vocab = scaled.logits.shape
    pad = -vocab % BLOCK
    x = F.pad(scaled.dense(), (0, pad), value=float("-inf")).view(rows, -1, BLOCK)
    top, arg = x.amax(dim=-1), x.argmax(dim=-1)
    total = (x - top[..., None]).exp_().nan_to_num_(0.0).sum(dim=-1)  # -inf - -inf: an empty block
    return Blocks(top, total, arg + torch.arange(0, vocab + pad, BLOCK, device=x.device))


def draw(scaled: Scaled, u: torch.Tensor, blocks: Blocks | None = None) -> torch.Tensor:
    """The inverse-CDF draw of each row of softmax(``scaled``) at its uniform ``u`` [R] (float64): the first
    token whose cumulative probability exceeds u, in two levels (the block that holds u, from the block sums,
    then the token within it), where one cumulative sum over a 152k vocabulary is a slow scan. A token of
    probability 0 is never drawn. ``blocks``: its ``block_stats``, when known."""
    vocab = scaled.logits.shape[1]
    blocks = block_stats(scaled) if blocks is None else blocks
    top = blocks.max.amax(dim=-1, keepdim=True)
    cdf = (blocks.sum * (blocks.max - top).exp()).cumsum(dim=-1)
    total = cdf[:, -1:]
    # right=True never lands on a zero-probability block or token; float rounding keeps u below each total.
    target = torch.minimum(
        (u[:, None] * total.double()).float(), torch.nextafter(total, torch.zeros_like(total))
    )
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block * BLOCK + torch.arange(BLOCK, device=cdf.device)
    within = ((scaled.at(index.clamp(max=vocab - 1)) - top).exp() * (index < vocab)).cumsum(dim=-1)
    rest = torch.minimum(target - before, torch.nextafter(within[:, -1:], torch.zeros_like(total)))
    offset = torch.searchsorted(within, rest, right=True).clamp_(max=BLOCK - 1)
    return (block * BLOCK + offset).squeeze(-1).clamp_(max=vocab - 1)


class SlotSampling:
    """The sampling settings and token counters of every slot, on the device."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        zeros = lambda dtype: torch.zeros(slots, dtype=dtype, device=device)  # noqa: E731
        self.temperature, self.top_p = zeros(torch.float32), zeros(torch.float32)
        self.top_k, self.seed, self.count, self.min_new = (zeros(torch.long) for _ in range(4))
        self.stop_ids = torch.zeros(slots, 1, dtype=torch.long, device=device)  # sorted, padded with the last
        self.filtered: set[int] = set()  # slots whose rows use top-k or top-p: the step takes the sort path
        self.widened = 0  # times the stop table was reallocated: a graph that samples reads the old one

    def set(
        self,
        slots: list[int],
        params: list[SamplingParams],
        seeds: list[int],
        stops: list[frozenset],
        counts: list[int] | None = None,
    ) -> None:
        """Give ``slots`` their rows' settings, with ``counts`` tokens generated so far (default none)."""
        index = torch.tensor(slots, device=self.device)
        put = lambda t, values: t.index_copy_(0, index, torch.tensor(values, dtype=t.dtype).to(self.device))  # noqa: E731
        put(self.temperature, [p.temperature for p in params])
        put(self.top_p, [p.top_p for p in params])
        put(self.top_k, [p.top_k if p.top_k > 0 else self.vocab for p in params])
        put(self.seed, seeds)
        put(self.count, counts or [0] * len(slots))
        rows = [sorted(t for t in s if t < self.vocab) for s in stops]
        # A row with no stop id in the vocabulary bans nothing: its table holds token 0, never banned.
        put(self.min_new, [p.min_new_tokens if r else 0 for p, r in zip(params, rows, strict=True)])
        rows = [r or [0] for r in rows]
        width = max(max(len(r) for r in rows), self.stop_ids.shape[1])
        if width > self.stop_ids.shape[1]:  # running rows repeat their own last id: zeros would ban token 0
            extra = self.stop_ids[:, -1:].expand(-1, width - self.stop_ids.shape[1])
            self.stop_ids = torch.cat([self.stop_ids, extra], dim=1)
            self.widened += 1
        put(self.stop_ids, [r + [r[-1]] * (width - len(r)) for r in rows])
        for slot, p in zip(slots, params, strict=True):
            (self.filtered.add if p.top_k > 0 or p.top_p < 1.0 else self.filtered.discard)(slot)

    def move(self, src: int, dst: int) -> None:
        for t in (
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.count,
            self.min_new,
            self.stop_ids,
        ):
            t[dst] = t[src]
        if src in self.filtered:
            self.filtered.discard(src)
            self.filtered.add(dst)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its logprob for each of ``slots`` from its ``logits`` row [R, V]; counts the token."""
        temperature = self.temperature[slots]
        greedy = temperature <= GREEDY_TEMPERATURE
        count = self.count[slots]
        # Before min_new_tokens a row may not draw its stop tokens.
        scaled = Scaled(logits, 1.0 / torch.where(greedy, 1.0, temperature), self.stop_ids[slots],
                        count < self.min_new[slots])  # fmt: skip
        blocks = block_stats(scaled)
        lse = _logsumexp(scaled, blocks)
        if self.filters(slots):
            scaled = Scaled.of(filter_top_k_top_p(scaled.dense(), self.top_k[slots], self.top_p[slots]))
            blocks = block_stats(scaled)
        best = blocks.arg.gather(1, blocks.max.argmax(dim=-1, keepdim=True)).squeeze(-1)
        tokens = torch.where(greedy, best, draw(scaled, uniforms(self.seed[slots], count), blocks))
        self.count[slots] += 1
        # A drawn token is never banned nor filtered out: its value here is its scaled logit.
        return tokens, scaled.at(tokens[:, None]).squeeze(-1) - lse

    def filters(self, slots: torch.Tensor | slice) -> bool:
        """Whether a row of ``slots`` uses top-k or top-p (a prefill's slots: whether any row does)."""
        if not self.filtered:
            return False
        if isinstance(slots, slice):
            return any(s < slots.stop for s in self.filtered)
        return True  # a prefill: rare, so the sort runs without checking which rows need it


def _logsumexp(scaled: Scaled, blocks: Blocks) -> torch.Tensor:
    """The logprob's normaliser, over the WHOLE vocabulary: the allowed tokens' (from their blocks) and the
    banned ones'."""
    top = blocks.max.amax(dim=-1)
    allowed = top + (blocks.sum * (blocks.max - top[:, None]).exp()).sum(dim=-1).log()
    stops = scaled.stops
    once = torch.ones_like(stops, dtype=torch.bool)  # padding repeats a row's last stop id: count it once
    once[:, 1:] = stops[:, 1:] != stops[:, :-1]
    banned = scaled.logits.gather(1, stops).float() * scaled.scale[:, None]
    banned = banned.masked_fill_(~(once & scaled.banned[:, None]), float("-inf")).logsumexp(dim=-1)
    return torch.logaddexp(allowed, banned)


if triton is not None:

    @triton.jit
    def _block_stats_kernel(
        logits_ptr, scale_ptr, stops_ptr, banned_ptr, max_ptr, sum_ptr, arg_ptr, vocab, blocks, stride, stops,
        BLOCK_: tl.constexpr, PER: tl.constexpr,
    ):  # fmt: skip
        """Program (row, j): blocks j * PER .. j * PER + PER - 1 of the row, as one [PER, BLOCK_] tile. The stop
        table's width is an argument: as a constant it compiled the kernel again, unrolled, for each new width
        (the likely cause of a request with 511 stop ids stalling an H100 engine past 120 s)."""
        row = tl.program_id(0)
        scale = tl.load(scale_ptr + row)
        banned = tl.load(banned_ptr + row) != 0
        b = tl.program_id(1) * PER + tl.arange(0, PER)
        index = b[:, None] * BLOCK_ + tl.arange(0, BLOCK_)[None, :]
        x = tl.load(logits_ptr + row * stride + index, mask=index < vocab, other=float("-inf"))
        x = x.to(tl.float32) * scale
        if banned:
            for j in range(stops):
                x = tl.where(index == tl.load(stops_ptr + row * stops + j), float("-inf"), x)
        top = tl.max(x, axis=1)
        arg = tl.argmax(x, axis=1, tie_break_left=True)
        total = tl.where(top == float("-inf"), 0.0, tl.sum(tl.exp(x - top[:, None]), axis=1))
        out = row * blocks + b
        tl.store(max_ptr + out, top, mask=b < blocks)
        tl.store(sum_ptr + out, total, mask=b < blocks)
        tl.store(arg_ptr + out, b * BLOCK_ + arg, mask=b < blocks)


LAUNCH = {"per": 8, "warps": 4}  # blocks a program reads and its warps (tools/bench_sampling.py sweeps them)


def _block_stats_triton(scaled: Scaled) -> Blocks:
    logits = scaled.logits if scaled.logits.stride(1) == 1 else scaled.logits.contiguous()
    rows, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    out = Blocks(
        logits.new_empty(rows, blocks, dtype=torch.float32),
        logits.new_empty(rows, blocks, dtype=torch.float32),
        logits.new_empty(rows, blocks, dtype=torch.long),
    )
    stops, per = scaled.stops.contiguous(), LAUNCH["per"]
    _block_stats_kernel[(rows, -(-blocks // per))](
        logits, scaled.scale.float().contiguous(), stops, scaled.banned.to(torch.int8), *out,
        vocab, blocks, logits.stride(0), stops.shape[1], BLOCK_=BLOCK, PER=per, num_warps=LAUNCH["warps"],
    )  # fmt: skip
    return out
