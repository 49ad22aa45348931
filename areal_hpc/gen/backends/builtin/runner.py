"""The model runner: prefill and decode steps of the decoder over the slots of the KV cache, on CPU or one GPU.

A decode step runs slots 0..B-1 (B a bucket size: the scheduler keeps running rows in the lowest slots) and reads
and writes only device tensors (each slot's last token, position and sampling state), so on a GPU it is
captured once per bucket in a CUDA graph and replayed. Attention on a GPU is FlashAttention's variable-length
kernel (torch's own op): each slot attends over its own length of the static cache (``seqused_k``), so a step
reads only the keys it needs and never pads. Elsewhere it is torch SDPA with a length mask. The step's tokens
and logprobs come back through a pinned buffer, copied asynchronously: the host reads a step's results while
the device runs the next one.

With routed-expert recording on (a mixture of experts), every forward also writes each token's chosen experts,
[tokens, layers, k] (zeros on dense layers), into a device buffer: a decode step's come back with its tokens, a
prefill's with its results.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from areal_hpc.gen.backends.builtin.cache import KVCache
from areal_hpc.gen.backends.builtin.model import Decoder
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
    """A prefill's first tokens and logprobs, slot by slot of its groups, and with recording on each prompt's
    routed experts [prompt length, layers, k]."""

    tokens: list[int]
    logprobs: list[float]
    routed: list[np.ndarray] | None = None


class Runner:
    """The decoder, the KV cache and each slot's decode state (last token, position, sampling settings)."""

    def __init__(self, decoder: Decoder, slots: int, slot_len: int, record: bool = False):
        self.decoder, self.slots, self.slot_len = decoder, slots, slot_len
        device, shape = decoder.device, decoder.shape
        self.cache = KVCache(shape, slots, slot_len, device, decoder.dtype)
        self.sampling = SlotSampling(slots, shape.vocab, device)
        zeros = lambda: torch.zeros(slots, dtype=torch.long, device=device)  # noqa: E731
        self.tokens, self.positions, self.live = zeros(), zeros(), zeros()
        self.cuda = device.type == "cuda"
        self.use_graphs = self.cuda  # off: eager decode steps (checks compare the two)
        self.flash = flash_works(device, decoder.dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        steps = torch.arange(slots + 1, device=device, dtype=torch.int32)
        self._cu_q, self._cu_k, self._rows = steps, steps * slot_len, torch.arange(slots, device=device)
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

    # --- prefill -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slot_groups: list[list[int]]) -> Prefilled:
        """Run ``prompts`` once each, fill the cache of every slot of its group with its keys and values, and
        sample each slot's first token; returns the tokens and logprobs, slot by slot of the groups (and with
        recording on, each prompt's routed experts)."""
        device, lens = self.decoder.device, [len(p) for p in prompts]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        # Each slot of a group takes its prompt's keys and values: one indexed write per layer.
        writes = [(s, j) for j, group in enumerate(slot_groups) for s in group]
        dst_slot = torch.tensor([s for s, j in writes for _ in range(lens[j])], device=device)
        dst_pos = torch.cat([torch.arange(lens[j], device=device) for _, j in writes])
        src = torch.cat([torch.arange(starts[j], starts[j + 1], device=device) for _, j in writes])
        cu = torch.tensor(starts, device=device, dtype=torch.int32)

        def attend(layer: int, q, k, v):
            self.cache.k[layer][dst_slot, dst_pos] = k[src]
            self.cache.v[layer][dst_slot, dst_pos] = v[src]
            if self.flash:
                return flash_varlen(q, k, v, cu, cu, max(lens), max(lens), True)
            return torch.cat(
                [_causal(q[a:b], k[a:b], v[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
            )

        last = torch.tensor(starts[1:], device=device) - 1
        record = None
        if self.routed_shape:
            record = torch.zeros(len(ids), *self.routed_shape, dtype=torch.int32, device=device)
        logits = self.decoder.forward(ids, positions, attend, last=last, record=record)
        slots = torch.tensor([s for s, _ in writes], device=device)
        tokens, logprobs = self.sampling.sample(
            logits[torch.tensor([j for _, j in writes], device=device)], slots
        )
        self.tokens[slots] = tokens
        self.positions[slots] = torch.tensor([lens[j] for _, j in writes], device=device)
        self.live[slots] = 1
        routed = None
        if record is not None:
            record = record.cpu().numpy()
            routed = [record[a:b] for a, b in zip(starts, starts[1:], strict=False)]
        return Prefilled(tokens.tolist(), logprobs.tolist(), routed)

    # --- decode --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, batch: int) -> Fetched:
        """One token for each of slots 0..batch-1 (free ones compute and are ignored); the results are fetched
        asynchronously."""
        logits = self._replay(batch) if self.use_graphs else self._decode_logits(batch)
        tokens, logprobs = self.sampling.sample(logits, slice(0, batch))
        self.tokens[:batch] = tokens
        self.positions[:batch] = (self.positions[:batch] + self.live[:batch]).clamp_(max=self.slot_len - 1)
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

    def _decode_logits(self, batch: int) -> torch.Tensor:
        positions, rows = self.positions[:batch], self._rows[:batch]
        lengths = (positions + 1).to(torch.int32)
        shape = self.decoder.shape

        def attend(layer: int, q, k, v):
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            k_cache[rows, positions] = k
            v_cache[rows, positions] = v
            k_cache, v_cache = k_cache[:batch], v_cache[:batch]
            if self.flash:
                k_all, v_all = (t.view(-1, shape.kv_heads, shape.head_dim) for t in (k_cache, v_cache))
                cu_q, cu_k = self._cu_q[: batch + 1], self._cu_k[: batch + 1]
                return flash_varlen(q, k_all, v_all, cu_q, cu_k, 1, self.slot_len, False, lengths)
            # GQA without copies: the query heads of one KV head are its "positions"; graphs need a fixed span.
            span = self.slot_len if self.cuda else int(lengths.max())
            group = shape.heads // shape.kv_heads
            valid = torch.arange(span, device=q.device) < lengths[:, None]
            # Positions never written hold any bits (a resumed cache): NaN survives a mask (NaN - inf, 0 x NaN).
            keys, values = (torch.where(valid[:, :, None, None], t[:, :span], 0) for t in (k_cache, v_cache))
            out = F.scaled_dot_product_attention(
                q.view(batch, shape.kv_heads, group, shape.head_dim),
                keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid[:, None, None],
            )  # fmt: skip
            return out.reshape(batch, shape.heads, shape.head_dim)

        record = self._routed[:batch] if self.routed_shape else None
        return self.decoder.forward(self.tokens[:batch], positions, attend, static=True, record=record)

    def _replay(self, batch: int) -> torch.Tensor:
        """The decode logits of ``batch`` slots through that bucket's CUDA graph, captured at first use."""
        if batch not in self.graphs:
            # Warm up outside the graph; re-running a step writes the same keys and values, so it is harmless.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._decode_logits(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._decode_logits(batch)
            self._pool = graph.pool()
            self.graphs[batch] = (graph, logits)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits

    # --- slots ---------------------------------------------------------------------------------------------

    def free(self, slots: list[int]) -> None:
        """Stop decoding ``slots``: their position stays 0, so a step reads one key of them."""
        index = torch.tensor(slots, device=self.decoder.device)
        self.live.index_fill_(0, index, 0)
        self.positions.index_fill_(0, index, 0)

    def move(self, src: int, dst: int, length: int) -> None:
        """Move a running row from slot ``src`` to the free slot ``dst``."""
        self.cache.move(src, dst, length)
        self.sampling.move(src, dst)
        for t in (self.tokens, self.positions, self.live):
            t[dst] = t[src]
        self.free([src])


def _routed_shape(decoder: Decoder) -> tuple[int, int]:
    """(layers, k) of a token's routed experts; only a mixture of experts has them."""
    moe = decoder.shape.moe
    if moe is None:
        raise ValueError("routed-expert recording needs a mixture-of-experts model; this one is dense")
    return decoder.shape.layers, moe.top_k


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one prompt: q [T, H, D], k and v [T, Hkv, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
