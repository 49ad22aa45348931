"""The model runner: prefill and decode steps of the decoder over the paged KV cache, on CPU or one GPU.

Each slot (a running row) has a row of the block table: the pages of the pool (``cache.py``) that hold its
keys and values, position p in page ``table[slot, p // PAGE]``. A decode step runs slots 0..B-1 (B a bucket
size: the scheduler keeps running rows in the lowest slots) and reads and writes only device tensors (each
slot's last token, position, block-table row and sampling state), so on a GPU it is captured once per bucket
in a CUDA graph and replayed; its attention is the paged kernel of ``paged_decode`` (Triton), which reads each
key once per KV head. A prefill writes the new tokens' keys and values into their pages and attends over the
row's whole context gathered from the pool (a cached prefix included), with FlashAttention's variable-length
kernel on a GPU, torch SDPA elsewhere. The step's tokens and logprobs come back through a pinned buffer,
copied asynchronously: the host reads a step's results while the device runs the next one.

With routed-expert recording on (a mixture of experts), every forward also writes each token's chosen experts,
[tokens, layers, k] (zeros on dense layers), into a device buffer: a decode step's come back with its tokens, a
prefill's with its results.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from areal_hpc.control import timeline
from areal_hpc.gen.backends.builtin import paged_decode
from areal_hpc.gen.backends.builtin.cache import KVCache, Plan
from areal_hpc.gen.backends.builtin.model import Decoder
from areal_hpc.gen.backends.builtin.paged_decode import PAGE
from areal_hpc.gen.backends.builtin.sampling import SlotSampling

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket(rows: int, slots: int) -> int:
    """The batch size a decode step of ``rows`` slots runs at (graphs exist for these sizes only)."""
    fits = [b for b in BUCKETS if b >= rows] or [-(-rows // 64) * 64]
    return min(fits[0], slots)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, used_k=None) -> torch.Tensor:
    """torch's FlashAttention over packed sequences: q [Tq, H, D], k and v [Tk, Hkv, D] (GQA needs no copies)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=q.shape[-1] ** -0.5, seqused_k=used_k
    )
    return out[0]


def flash_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FlashAttention's variable-length op runs here and agrees with SDPA (it needs an sm80+ GPU)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        gen = torch.Generator(device).manual_seed(0)
        q, k = (torch.randn(2, 4, 64, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
        expected = F.scaled_dot_product_attention(q[:, :, -1:], k, k)[:, :, 0]  # [2, 4, 64]
        packed = k.transpose(1, 2).reshape(128, 4, 64)
        cu = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
        used = torch.tensor([64, 64], device=device, dtype=torch.int32)
        cu_k = torch.tensor([0, 64, 128], device=device, dtype=torch.int32)
        got = flash_varlen(q[:, :, -1].contiguous(), packed, packed, cu, cu_k, 1, 64, False, used)
        return torch.allclose(got, expected, atol=2e-2)
    except Exception as exc:  # no kernel for this GPU or torch: SDPA serves
        log.warning("FlashAttention's varlen op is not usable here (%s): decode attention uses SDPA", exc)
        return False


@dataclass
class Fetched:
    """A decode step's tokens and logprobs, on their way to the host (``event`` set once they are there), and
    with recording on each slot's routed experts [slots, layers, k]."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: torch.cuda.Event | None
    routed: torch.Tensor | None = None

    def lists(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()

    def routed_rows(self) -> np.ndarray | None:
        """The routed experts by slot (after ``lists``); a view of a buffer reused two steps later: copy rows."""
        return None if self.routed is None else self.routed.numpy()


@dataclass
class Prefilled:
    """A prefill's first tokens and logprobs, slot by slot of its groups, and with recording on each group's
    routed experts [new tokens, layers, k]."""

    tokens: list[int]
    logprobs: list[float]
    routed: list[np.ndarray] | None = None


@dataclass
class Group:
    """Rows with one context, prefilled together: the context's tokens from ``start`` on are new (the ones
    before are in the pages already), and each row's ``pages`` cover the whole context."""

    context: list[int]
    start: int
    slots: list[int]
    pages: list[list[int]]


class Runner:
    """The decoder, the KV pool and each slot's decode state (last token, position, pages, sampling)."""

    def __init__(self, decoder: Decoder, slots: int, plan: Plan, record: bool = False):
        self.decoder, self.slots, self.plan = decoder, slots, plan
        device, shape = decoder.device, decoder.shape
        self.cache = KVCache(shape, plan.pages, device, decoder.dtype)
        self.width = -(-plan.context_len // PAGE)  # pages of a row at full context
        self.table = torch.zeros(slots, self.width, dtype=torch.int32, device=device)
        self.sampling = SlotSampling(slots, shape.vocab, device)
        zeros = lambda: torch.zeros(slots, dtype=torch.long, device=device)  # noqa: E731
        self.tokens, self.positions, self.live = zeros(), zeros(), zeros()
        self.cuda = device.type == "cuda"
        self.use_graphs = self.cuda  # off: eager decode steps (checks compare the two)
        self.flash = flash_works(device, decoder.dtype)
        self.kernel = paged_decode.available(device, decoder.dtype)
        if self.cuda and not self.kernel:
            log.warning("the paged decode kernel needs triton on an sm80+ GPU: decode attention gathers keys")
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count if self.cuda else 1
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Any]] = {}  # by (rows, sampled)
        # graph_captures and graph_capture_secs (the scheduler's counters join them, for /server_info): a
        # release of the memory drops every graph, so a colocated server captures its buckets again each step.
        self.stats: Counter[str] = Counter()
        self._pool = None
        self._widened = 0  # the sampling's stop-table reallocations the graphs have seen
        self._rows = torch.arange(slots, device=device)
        pinned = self.cuda
        self._out = [
            (torch.zeros(slots, dtype=torch.long, pin_memory=pinned), torch.zeros(slots, pin_memory=pinned))
            for _ in range(2)
        ]  # two: the host reads one step's while the next step's copy is under way
        self._flip = 0
        self.routed_shape = _routed_shape(decoder) if record else None
        if self.routed_shape:  # a decode step's record, on the device (graphs write it) and two host copies
            self._routed = torch.zeros(slots, *self.routed_shape, dtype=torch.int32, device=device)
            size = self._routed.shape
            self._routed_out = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]

    # --- memory --------------------------------------------------------------------------------------------

    def release(self, weights: bool, cache: bool) -> None:
        """Give back the weights' and/or the cache's memory; captured graphs point at them, so they go too."""
        self.graphs, self._pool = {}, None
        if weights:
            self.decoder.release()
        if cache:
            self.cache.release()
        if self.cuda:
            torch.cuda.empty_cache()

    def resume(self, weights: bool, cache: bool) -> None:
        self.graphs, self._pool = {}, None
        if weights:
            self.decoder.allocate()
        if cache:
            self.cache.allocate()

    # --- pages ---------------------------------------------------------------------------------------------

    def set_pages(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """Write block-table entries: for each (slot, first, pages), ``table[slot, first:]`` = pages (one
        indexed write, queued behind the steps in flight, which still read the old entries)."""
        rows = [slot for slot, _, pages in updates for _ in pages]
        cols = [first + i for _, first, pages in updates for i in range(len(pages))]
        values = [page for _, _, pages in updates for page in pages]
        if values:
            device = self.table.device
            index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
            self.table.index_put_(index, torch.tensor(values, dtype=torch.int32, device=device))

    # --- prefill -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, groups: list[Group]) -> Prefilled:
        """Run each group's new tokens once, write their keys and values into the pages of every row of the
        group (pages rows share are written once), and sample each row's first token; returns the tokens and
        logprobs, slot by slot of the groups (and with recording on, each group's routed experts)."""
        device = self.decoder.device
        new = [len(g.context) - g.start for g in groups]
        total = [len(g.context) for g in groups]
        cu_q, cu_k = np.cumsum([0, *new]), np.cumsum([0, *total])
        ids = torch.tensor([t for g in groups for t in g.context[g.start :]], device=device)
        positions = torch.from_numpy(np.concatenate([np.arange(g.start, len(g.context)) for g in groups]))
        dst, src = _writes(groups, cu_q)
        keys = np.concatenate([_slots_of(g.pages[0], np.arange(len(g.context))) for g in groups])
        dst, src, keys = (torch.from_numpy(a).to(device) for a in (dst, src, keys))
        cu_q_t, cu_k_t = (torch.tensor(a, device=device, dtype=torch.int32) for a in (cu_q, cu_k))

        def attend(layer: int, q, k, v):
            k_all, v_all = self.cache.flat(layer)
            k_all[dst], v_all[dst] = k[src], v[src]
            k, v = k_all[keys], v_all[keys]
            if self.flash:  # causal, aligned to the end: new token i of a group sees the prefix and i
                return flash_varlen(q, k, v, cu_q_t, cu_k_t, max(new), max(total), True)
            spans = zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False)
            return torch.cat([_causal(q[a:b], k[c:d], v[c:d]) for a, b, c, d in spans])

        last = torch.tensor(cu_q[1:], device=device) - 1
        record = None
        if self.routed_shape:
            record = torch.zeros(len(ids), *self.routed_shape, dtype=torch.int32, device=device)
        logits = self.decoder.forward(ids, positions.to(device), attend, last=last, record=record)
        owner = torch.tensor([j for j, g in enumerate(groups) for _ in g.slots], device=device)
        slots = torch.tensor([s for g in groups for s in g.slots], device=device)
        tokens, logprobs = self.sampling.sample(logits[owner], slots)
        self.tokens[slots] = tokens
        self.positions[slots] = torch.tensor(
            [total[j] for j, g in enumerate(groups) for _ in g.slots], device=device
        )
        self.live[slots] = 1
        routed = None
        if record is not None:
            record = record.cpu().numpy()
            routed = [record[a:b] for a, b in zip(cu_q, cu_q[1:], strict=False)]
        return Prefilled(tokens.tolist(), logprobs.tolist(), routed)

    # --- decode --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, batch: int) -> Fetched:
        """One token for each of slots 0..batch-1 (free ones compute and are ignored); the results are fetched
        asynchronously. On a GPU the step's sampling is in its graph too (its ~100 small kernels launched
        one by one kept the device waiting on the host), unless a row filters by top-k or top-p."""
        if self.sampling.widened != self._widened:  # graphs that sample read the stop table they captured
            self.graphs = {key: g for key, g in self.graphs.items() if not key[1]}
            self._widened = self.sampling.widened
        if self.use_graphs and not self.sampling.filters(slice(0, batch)):
            tokens, logprobs = self._replay(batch, sample=True)
        else:
            logits = self._replay(batch, sample=False) if self.use_graphs else self._decode_logits(batch)
            tokens, logprobs = self._advance(batch, logits)
        flip, self._flip = self._flip, self._flip ^ 1
        out_tokens, out_logprobs = (t[:batch] for t in self._out[flip])
        out_tokens.copy_(tokens, non_blocking=True)
        out_logprobs.copy_(logprobs, non_blocking=True)
        routed = None
        if self.routed_shape:
            routed = self._routed_out[flip][:batch]
            routed.copy_(self._routed[:batch], non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return Fetched(out_tokens, out_logprobs, event, routed)

    def _advance(self, batch: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the step's tokens and make them the next step's input."""
        tokens, logprobs = self.sampling.sample(logits, slice(0, batch))
        self.tokens[:batch] = tokens
        last = self.width * PAGE - 1
        self.positions[:batch] = (self.positions[:batch] + self.live[:batch]).clamp_(max=last)
        return tokens, logprobs

    def _decode_step(self, batch: int, sample: bool) -> Any:
        logits = self._decode_logits(batch)
        return self._advance(batch, logits) if sample else logits

    def _decode_logits(self, batch: int) -> torch.Tensor:
        positions, table = self.positions[:batch], self.table[:batch]
        lengths = (positions + 1).to(torch.int32)
        where = table[self._rows[:batch], positions // PAGE].long() * PAGE + positions % PAGE
        shape = self.decoder.shape
        if self.kernel:
            scale, splits = (
                shape.head_dim**-0.5,
                paged_decode.splits_for(batch, shape.kv_heads, self.width, self._sms),
            )
            cos, sin = self.decoder.cos[positions], self.decoder.sin[positions]
        else:  # every layer gathers the same positions: their pool rows once, [batch, span]
            span = self.width if self.cuda else -(-int(lengths.max()) // PAGE)  # graphs need a fixed span
            keys = paged_decode.pool_rows(table[:, :span])
            valid = torch.arange(span * PAGE, device=keys.device) < lengths[:, None]

        def attend(layer: int, q, k, v):
            k_all, v_all = self.cache.flat(layer)
            if self.kernel:  # q and k arrive unrotated: one kernel rotates them and writes the cache
                q = paged_decode.rotate_and_store(q, k, v, cos, sin, k_all, v_all, where)
                return paged_decode.paged_decode(
                    q, self.cache.k[layer], self.cache.v[layer], table, lengths, scale, splits
                )
            k_all[where], v_all[where] = k, v
            return paged_decode.gathered_decode(q, k_all, v_all, keys, valid)

        record = self._routed[:batch] if self.routed_shape else None
        return self.decoder.forward(
            self.tokens[:batch], positions, attend, static=True, record=record, rotates=self.kernel
        )

    def _replay(self, batch: int, sample: bool) -> Any:
        """A decode step of ``batch`` slots through its CUDA graph, captured at first use: its logits, or with
        ``sample`` its tokens and logprobs (the next step's input written)."""
        key = (batch, sample)
        if key not in self.graphs:
            start = time.monotonic()
            with timeline.span("capture_graph", rows=batch, sample=sample):
                # Warm up outside the graph (compiling what it runs); re-running a step writes the same keys
                # and values, and what sampling advances is put back.
                advanced = (self.sampling.count, self.tokens, self.positions)
                state = [t.clone() for t in advanced]
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._decode_step(batch, sample)
                torch.cuda.current_stream().wait_stream(stream)
                for t, saved in zip(advanced, state, strict=True):
                    t.copy_(saved)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._decode_step(batch, sample)
            self._pool = graph.pool()
            self.graphs[key] = (graph, out)
            self.stats["graph_captures"] += 1
            self.stats["graph_capture_secs"] += time.monotonic() - start
        graph, out = self.graphs[key]
        graph.replay()
        return out

    # --- slots ---------------------------------------------------------------------------------------------

    def free(self, slots: list[int]) -> None:
        """Stop decoding ``slots``: their position stays 0 and their pages are the scratch page 0, so a step
        writes and reads one harmless key of them."""
        index = torch.tensor(slots, device=self.decoder.device)
        self.live.index_fill_(0, index, 0)
        self.positions.index_fill_(0, index, 0)
        self.table.index_fill_(0, index, 0)

    def move(self, src: int, dst: int) -> None:
        """Move a running row from slot ``src`` to the free slot ``dst`` (its pages go with its table row)."""
        self.sampling.move(src, dst)
        for t in (self.tokens, self.positions, self.live, self.table):
            t[dst] = t[src]
        self.free([src])


def _slots_of(pages: list[int], positions: np.ndarray) -> np.ndarray:
    """Pool rows (page * PAGE + offset) of ``positions`` of a row with ``pages``."""
    return np.asarray(pages, dtype=np.int64)[positions // PAGE] * PAGE + positions % PAGE


def _writes(groups: list[Group], cu_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pool rows, packed new tokens) of the keys and values a prefill writes: every row's new positions, a
    pool row that several rows share written once."""
    dst, src = [], []
    for group, first in zip(groups, cu_q, strict=False):
        new = np.arange(group.start, len(group.context))
        for pages in group.pages:
            dst.append(_slots_of(pages, new))
            src.append(first + new - group.start)
    dst_all, src_all = np.concatenate(dst), np.concatenate(src)
    dst_all, unique = np.unique(dst_all, return_index=True)
    return dst_all, src_all[unique]


def _routed_shape(decoder: Decoder) -> tuple[int, int]:
    """(layers, k) of a token's routed experts; only a mixture of experts has them."""
    moe = decoder.shape.moe
    if moe is None:
        raise ValueError("routed-expert recording needs a mixture-of-experts model; this one is dense")
    return decoder.shape.layers, moe.top_k


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one row's new tokens q [Tq, H, D] over its context k, v [Tk, Hkv, D] (Tk >= Tq: the
    new tokens are the last Tq, each seeing the prefix and itself)."""
    offset = k.shape[0] - q.shape[0]
    mask = (
        torch.arange(k.shape[0], device=q.device)
        <= offset + torch.arange(q.shape[0], device=q.device)[:, None]
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
