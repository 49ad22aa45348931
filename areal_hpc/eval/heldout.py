"""Held-out greedy accuracy during training: one greedy answer per prompt, scored by its task's reward."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def greedy_accuracy(clients: Sequence, prompts: Sequence, rewards, max_new_tokens: int) -> float:
    """Fraction of prompts whose greedy answer is correct; prompts are spread over the servers."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "n": 1}
    chunks = [list(range(i, len(prompts), len(clients))) for i in range(len(clients))]

    def answer(chunk: list[int], client) -> list[tuple[str, list[int]]]:
        if not chunk:
            return []
        responses = client.generate([list(prompts[i].input_ids) for i in chunk], params)
        return [(r["text"], r["output_ids"]) for r in responses]

    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        texts = list(pool.map(answer, chunks, clients))
    items = [
        (text, prompts[i], ids)
        for chunk, part in zip(chunks, texts, strict=True)
        for i, (text, ids) in zip(chunk, part, strict=True)
    ]
    return sum(rewards.score_batch(items)) / max(len(items), 1)
