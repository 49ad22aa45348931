"""Supervised warm-up sequences: the prompt followed by its first reference solution and EOS, or by its worked
conversation (a record's `messages`: assistant turns with tool calls, tool results), trained on the assistant's
tokens only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from areal_hpc.data.dataset import PromptSample

# (prompt messages, the messages after them) -> (ids, which ids are the assistant's): agent.ChatRenderer.transcript
Transcript = Callable[[list[dict], Sequence[dict]], tuple[list[int], list[bool]]]


def sft_arrays(
    prompts: Sequence[PromptSample], tokenizer, transcript: Transcript | None = None
) -> dict[str, np.ndarray]:
    """Packed `packed_input_ids` and `prompt_mask` (the loss falls on the solution and its EOS, or on the
    assistant's turns of a worked conversation, only)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; SFT answers must end with one")
    ids: list[int] = []
    mask: list[bool] = []
    lengths = []
    for prompt in prompts:
        if prompt.messages is not None:
            if transcript is None:
                raise ValueError(f"prompt {prompt.query_id!r} has messages, but no chat renderer was given")
            seq, mine = transcript([{"role": "user", "content": prompt.prompt}], prompt.messages)
            ids += seq
            mask += [not m for m in mine]
            lengths.append(len(seq))
            continue
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
