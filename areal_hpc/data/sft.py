"""Supervised warm-up sequences: the prompt followed by its first reference solution and EOS."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from areal_hpc.data.dataset import PromptSample


def sft_arrays(prompts: Sequence[PromptSample], tokenizer) -> dict[str, np.ndarray]:
    """Packed `packed_input_ids` and `prompt_mask` (the loss falls on the solution and its EOS only)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; SFT answers must end with one")
    ids: list[int] = []
    mask: list[bool] = []
    lengths = []
    for prompt in prompts:
        if not prompt.solutions:
            raise ValueError(f"prompt {prompt.query_id!r} has no solution to learn from")
        answer = tokenizer.encode(prompt.solutions[0], add_special_tokens=False) + [tokenizer.eos_token_id]
        ids += list(prompt.input_ids) + answer
        mask += [True] * len(prompt.input_ids) + [False] * len(answer)
        lengths.append(len(prompt.input_ids) + len(answer))
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "packed_input_ids": np.asarray(ids, dtype=np.int64),
        "prompt_mask": np.asarray(mask, dtype=bool),
    }
