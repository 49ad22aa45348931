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

import torch

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


def draw(allowed: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of each row of softmax(``allowed``) [R, V] at its uniform ``u`` [R] (float64): the
    first token whose cumulative probability exceeds u, in two levels (the block of ``BLOCK`` tokens that holds
    u, then the token within it), where one cumulative sum over a 152k vocabulary is a slow scan. A token of
    probability 0 is never drawn."""
    rows, vocab = allowed.shape
    p = (allowed - allowed.amax(dim=-1, keepdim=True)).exp_()  # unnormalised; the max is after the bans
    full = vocab - vocab % BLOCK
    sums = p[:, :full].view(rows, -1, BLOCK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat([sums, p[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1:]
    # right=True never lands on a zero-probability block or token; float rounding keeps u below each total.
    target = torch.minimum(
        (u[:, None] * total.double()).float(), torch.nextafter(total, torch.zeros_like(total))
    )
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block * BLOCK + torch.arange(BLOCK, device=allowed.device)
    within = (p.gather(1, index.clamp(max=vocab - 1)) * (index < vocab)).cumsum(dim=-1)
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
        self.stop_ids = torch.zeros(slots, 1, dtype=torch.long, device=device)  # padded with a row's own id
        self.filtered: set[int] = set()  # slots whose rows use top-k or top-p: the step takes the sort path

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
        if width > self.stop_ids.shape[1]:  # running rows repeat their own first id: zeros would ban token 0
            extra = self.stop_ids[:, :1].expand(-1, width - self.stop_ids.shape[1])
            self.stop_ids = torch.cat([self.stop_ids, extra], dim=1)
        put(self.stop_ids, [r + [r[0]] * (width - len(r)) for r in rows])
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
        # A float32 divisor promotes bf16 logits: the upcast and the scaling are one pass.
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
        lse = scaled.logsumexp(dim=-1)  # the logprob's normaliser: the whole vocabulary, before any ban
        count, stop_ids = self.count[slots], self.stop_ids[slots]
        # Before min_new_tokens a row may not draw its stop tokens (padding repeats one, so writes agree).
        banned = (count < self.min_new[slots])[:, None].expand_as(stop_ids)
        allowed = scaled.scatter_(1, stop_ids, scaled.gather(1, stop_ids).masked_fill(banned, float("-inf")))
        if self._filters(slots):
            allowed = filter_top_k_top_p(allowed, self.top_k[slots], self.top_p[slots])
        drawn = draw(allowed, uniforms(self.seed[slots], count))
        tokens = torch.where(greedy, allowed.argmax(dim=-1), drawn)
        self.count[slots] += 1
        # A drawn token is never banned nor filtered out: its allowed logit is its scaled one.
        return tokens, allowed.gather(-1, tokens[:, None]).squeeze(-1) - lse

    def _filters(self, slots: torch.Tensor | slice) -> bool:
        if not self.filtered:
            return False
        if isinstance(slots, slice):
            return any(s < slots.stop for s in self.filtered)
        return True  # a prefill: rare, so the sort runs without checking which rows need it
