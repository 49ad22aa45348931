"""What the engine takes from a model directory besides the weights: the dtype to run in, the tokenizer and
the ids that end an answer."""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer, GenerationConfig

log = logging.getLogger(__name__)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``float32`` on CPU and ``bfloat16`` on GPU unless a dtype name is given."""
    if name in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def load_tokenizer(path: str):
    """The tokenizer at ``path``, or None (then only input_ids are accepted and no text is returned)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer at %s (%s): text input and output disabled", path, exc)
        return None


def eos_token_ids(path: str, config, tokenizer) -> frozenset[int]:
    """Every EOS id the model's configs or the tokenizer name."""
    try:
        generation = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        generation = None
    ids: set[int] = set()
    for value in (generation, config.eos_token_id):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
