"""The rows being decoded together over one causal LM: prefill, decode steps and pruning on a shared KV cache.

Rows are left-padded into one batch. New rows are prefilled on their own (a prompt shared by n samples once)
and joined to the running batch, so requests that arrive mid-generation start at the next step (continuous
batching); finished rows are dropped at once. Only the engine thread touches a Batch.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from areal_hpc.gen.backends.builtin import kv
from areal_hpc.gen.backends.builtin.protocol import SamplingParams
from areal_hpc.gen.backends.builtin.sampling import sample_tokens

# The attention kernels a GPU forward may use: not cuDNN's, which builds a plan for each new shape, and a decode
# step's grown KV length is a new shape at every layer (1.6 ms of host time a layer on an H200). Without it, decode
# steps of the Qwen2.5-1.5B shape are 2.3-3x faster (tools/gpu_bench_engine_sdpa.py, docs/benchmarks.md); the
# others take the same masks. None: torch's choice.
GPU_SDPA_BACKENDS: list[SDPBackend] | None = [
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
]  # fmt: skip


@dataclass(eq=False)
class Row:
    """One sequence being generated: one sample of one prompt of a request (its ``owner``)."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # tokens that end the row: EOS unless ignore_eos, and stop_token_ids
    generator: torch.Generator
    owner: Any = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, context_len: int) -> None:
        """Record a generated token and decide whether the row is finished."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        limit = self.params.max_new_tokens
        if token in self.stop_ids:  # stop tokens are banned before min_new_tokens, so this respects it
            self.finish_reason = {"type": "stop", "matched": token}
        elif limit is not None and len(self.output_ids) >= limit:
            self.finish_reason = {"type": "length", "length": limit}
        elif len(self.prompt) + len(self.output_ids) >= context_len:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}

    def abort(self, message: str) -> None:
        """Finish the row now with what it has, as SGLang reports an aborted request."""
        if not self.done:
            self.finish_reason = {"type": "abort", "message": message}


class Batch:
    """Rows decoded together: their KV cache, attention mask [B, L], next positions [B] and last tokens [B]."""

    def __init__(self, model: torch.nn.Module, context_len: int, pad_id: int = 0):
        self.context_len, self.pad_id = context_len, pad_id
        self.rows: list[Row] = []  # always replaced, never mutated: other threads may read a snapshot
        self.stats: Counter[str] = Counter()
        self.set_model(model)
        self._clear()

    def set_model(self, model: torch.nn.Module) -> None:
        """Decode the next steps with ``model`` (the cache of running rows is kept, as SGLang does)."""
        self.model = model
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = kv.cache_kwarg(model)
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _clear(self) -> None:
        self.rows, self.cache, self.mask, self.positions, self.last = [], None, None, None, None

    @torch.inference_mode()
    def admit(self, rows: list[Row]) -> list[Row]:
        """Prefill ``rows``, sample their first token and join them to the batch; returns rows that finished."""
        for row in rows:
            if row.params.max_new_tokens == 0:
                row.finish_reason = {"type": "length", "length": 0}
        empty, rows = [r for r in rows if r.done], [r for r in rows if not r.done]
        if not rows:
            return empty
        start = time.monotonic()
        unique: dict[tuple[int, ...], int] = {}
        index = [unique.setdefault(tuple(r.prompt), len(unique)) for r in rows]
        ids, mask = self._left_pad([list(p) for p in unique])
        cache = kv.new_cache()
        out = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, prefill=True)
        index_t = torch.tensor(index, device=self.device)
        if len(unique) < len(rows):  # n samples of one prompt share its prefill
            cache, mask = kv.select_rows(cache, index_t), mask[index_t]
        last = self._sample(rows, out.logits[index_t, -1])
        positions = mask.sum(-1)
        if self.rows:
            cache, mask = kv.join(self.cache, self.mask, cache, mask)
            positions, last = torch.cat([self.positions, positions]), torch.cat([self.last, last])
        self.rows, self.cache, self.mask = self.rows + rows, cache, mask
        self.positions, self.last = positions, last
        self._count_forward(rows, prefill=True, secs=time.monotonic() - start)
        return empty + self._prune()

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """Decode one token for every row; returns the rows that finished."""
        if not self.rows:
            return []
        start = time.monotonic()
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        out = self._forward(self.last[:, None], self.mask, self.positions[:, None], self.cache)
        self.positions = self.positions + 1
        self.last = self._sample(self.rows, out.logits[:, -1])
        self._count_forward(self.rows, prefill=False, secs=time.monotonic() - start)
        return self._prune()

    def abort(self, match: Callable[[Row], bool], message: str) -> list[Row]:
        """Finish every row for which ``match(row)`` holds, with finish reason abort; returns them."""
        for row in self.rows:
            if match(row):
                row.abort(message)
        return self._prune()

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, prefill: bool = False
    ) -> Any:
        """One forward pass extending ``cache``; at prefill only the last position's logits are computed."""
        extra = self._keep_last if prefill else {}
        gpu = self.device.type == "cuda" and GPU_SDPA_BACKENDS is not None
        with sdpa_kernel(GPU_SDPA_BACKENDS) if gpu else contextlib.nullcontext():
            return self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{self._cache_kwarg: cache}, **extra,
            )  # fmt: skip

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask [B, L] of prompts padded on the left to the longest one."""
        width = max(len(p) for p in prompts)
        ids = [[self.pad_id] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        return torch.tensor(ids, device=self.device), torch.tensor(mask, device=self.device)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
        """Sample a token per row, record it on the row and return the tokens [B] on the model's device."""
        vocab = logits.shape[-1]
        temperature = torch.tensor([r.params.temperature for r in rows], device=self.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=self.device)
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_k = torch.tensor(top_k, device=self.device)
        tokens, logprobs = sample_tokens(
            logits, temperature, top_p, top_k, [r.generator for r in rows], self._banned(rows, vocab)
        )
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            row.append(token, logprob, self.context_len)
        return tokens

    def _banned(self, rows: list[Row], vocab: int) -> torch.Tensor | None:
        """Stop tokens of rows that have not reached min_new_tokens yet (None when no row has any)."""
        early = [
            (i, r) for i, r in enumerate(rows) if r.stop_ids and len(r.output_ids) < r.params.min_new_tokens
        ]
        if not early:
            return None
        banned = torch.zeros(len(rows), vocab, dtype=torch.bool, device=self.device)
        for i, row in early:
            banned[i, [t for t in row.stop_ids if t < vocab]] = True
        return banned

    def _prune(self) -> list[Row]:
        """Drop finished rows (and cache columns no remaining row uses); returns the dropped rows."""
        finished = [r for r in self.rows if r.done]
        if not finished:
            return []
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if not keep:
            self._clear()
            return finished
        index = torch.tensor(keep, device=self.device)
        mask = self.mask[index]
        first = int(mask.any(dim=0).to(torch.int8).argmax())  # leading columns that are padding in every row
        cache = kv.select_rows(self.cache, index)
        self.cache = kv.drop_columns(cache, first) if first else cache
        self.mask, self.positions, self.last = mask[:, first:], self.positions[index], self.last[index]
        self.rows = [self.rows[i] for i in keep]
        return finished

    def _count_forward(self, rows: list[Row], prefill: bool, secs: float) -> None:
        """Counters shown by /server_info: they show whether concurrent requests shared forward passes, and
        where the engine's time went."""
        self.stats["forward_passes"] += 1
        self.stats["prefill_passes" if prefill else "decode_steps"] += 1
        self.stats["prefill_secs" if prefill else "decode_secs"] += secs
        self.stats["generated_tokens"] += len(rows)
        if not prefill:
            self.stats["decode_rows"] += len(rows)
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(rows))
        requests = len({id(r.owner) for r in rows})
        self.stats["max_requests_per_forward"] = max(self.stats["max_requests_per_forward"], requests)
