"""Interruptible generation of one group: answers that survive weight updates (REFERENCE.md section 4).

A weight update aborts the server's running requests; each returns what it has (finish reason abort). The
answer is then continued: prompt + tokens so far are sent again with the remaining token budget, to the new
weights. Tokens and behaviour logprobs are concatenated; the answer keeps the version of its first part
(version_start) and takes that of its last part (version_end).

Without interruption (``interruptible_generation: false``) a publication pauses answers in place and they go
on under the new weights: the server reports only the version at the end, so the version of the first
tokens is taken from the sender, who knows (a lower bound of) the version the server held when it sent.

Under routing replay (gen.routing) an answer keeps the routed experts of the last request that added tokens to
it: that request's prompt held every earlier token, so its routing covers the whole answer so far.

Each request's prompt tokens, and those of them the server took from its prefix cache (SGLang's meta_info
cached_tokens; a server that omits it cached none), are summed over the answer's parts (rollout statistics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from areal_hpc.gen.adapters import version_of
from areal_hpc.gen.routing import decode, shape_of

ABORT = "abort"


class Part(NamedTuple):
    """The tokens one request added to an answer and the weight versions they were sampled under: one version
    (first == last) unless the request was paused in place across updates; then first is a lower bound (the
    version its sender knew the server held) and how the tokens split between the versions is unknown."""

    tokens: int
    first: int
    last: int


@dataclass(frozen=True)
class PartialAnswer:
    """One answer so far, possibly made of parts generated under several weight versions."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str  # stop | length | abort (abort: interrupted, to be continued)
    version_start: int
    version_end: int
    parts: tuple[Part, ...] = ()  # each request's part, in order
    prompt_tokens: int = 0  # the prompt tokens its requests sent, summed over the parts
    cached_tokens: int = 0  # of those, the ones the server took from its prefix cache (not prefilled again)
    # Routing replay: [prompt + output_ids - 1, layers, top_k] expert ids of the last request (gen.routing).
    routing: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def n_parts(self) -> int:
        return len(self.parts)

    @property
    def interrupted(self) -> bool:
        return self.finish == ABORT

    @property
    def truncated(self) -> bool:
        return self.finish != "stop"


def from_response(
    response: dict, min_version: int | None = None, routing: np.ndarray | None = None, prompt_tokens: int = 0
) -> PartialAnswer:
    """The first part of an answer, from one /generate response object (a request aborted while still
    queued has no tokens, and SGLang then sends no logprobs). ``min_version``: the version the sender knew
    the server held when it sent, where a server may pause the request in place across an update (its
    response then reports only the version at its end). ``routing``: its decoded routing (`answers_of`).
    ``prompt_tokens``: the length of the ids the request sent."""
    meta = response["meta_info"]
    ids = tuple(int(t) for t in response["output_ids"])
    logprobs = tuple(float(item[0]) for item in meta.get("output_token_logprobs") or ())
    if len(ids) != len(logprobs):
        raise ValueError(f"server returned {len(ids)} tokens but {len(logprobs)} logprobs")
    last = version_of(meta.get("weight_version"))  # the server's when the request ended
    first = last if min_version is None else min(min_version, last)
    cached = int(meta.get("cached_tokens") or 0)  # an older server omits it
    part = Part(len(ids), first, last)
    finish = meta["finish_reason"]["type"]
    return PartialAnswer(ids, logprobs, finish, first, last, (part,), prompt_tokens, cached, routing)


def answers_of(
    client, responses: list[dict], prompt: Sequence[int], params: dict, min_version: int | None = None
) -> list[PartialAnswer]:
    """The answers of one request for ``prompt`` with ``params``; with their routing when the params ask for
    it (routing replay), a server that sent none failing here by name."""
    shape = shape_of(params)
    where = getattr(client, "where", None) or getattr(client, "url", "the generation server")
    return [
        from_response(r, min_version, decode(r, len(prompt), shape, where) if shape else None, len(prompt))
        for r in responses
    ]


def extend(answer: PartialAnswer, part: PartialAnswer) -> PartialAnswer:
    """`answer` continued by `part`, the answer to its resubmission."""
    return replace(
        answer,
        output_ids=answer.output_ids + part.output_ids,
        logprobs=answer.logprobs + part.logprobs,
        finish=part.finish,
        version_end=part.version_end,
        parts=answer.parts + part.parts,
        prompt_tokens=answer.prompt_tokens + part.prompt_tokens,
        cached_tokens=answer.cached_tokens + part.cached_tokens,
        # the last request that added tokens: one aborted while queued added none, and forwarded nothing
        routing=answer.routing if part.routing is None else part.routing,
    )


CACHE_COUNTS = ("requests", "prompt_tokens", "cached_tokens")  # what `cache_stats` is computed from


def cache_counts(answers: Iterable[PartialAnswer]) -> dict[str, int]:
    """The requests ``answers`` took (one per part), the prompt tokens they sent and those of them cached."""
    answers = list(answers)
    return {
        "requests": sum(a.n_parts for a in answers),
        "prompt_tokens": sum(a.prompt_tokens for a in answers),
        "cached_tokens": sum(a.cached_tokens for a in answers),
    }


def cache_stats(counts: Mapping[str, float]) -> dict[str, float]:
    """The prefix cache's statistics from summed `cache_counts` (a count missing is 0: a group's file written
    before they were counted): the cached tokens per request, and the share of the prompt tokens sent that the
    servers did not prefill again."""
    requests, prompt, cached = (counts.get(name, 0) for name in CACHE_COUNTS)
    return {
        "rollout/cached_tokens_per_request": cached / max(requests, 1),
        "rollout/cached_token_ratio": cached / max(prompt, 1),
    }


def continuation_params(params: dict, answer: PartialAnswer, index: int) -> dict:
    """Sampling params of the next part: one answer, the remaining budget, a seed of its own."""
    done = len(answer.output_ids)
    out = {**params, "n": 1, "max_new_tokens": params["max_new_tokens"] - done}
    out["min_new_tokens"] = max(0, params.get("min_new_tokens", 0) - done)
    if params.get("sampling_seed") is not None:
        out["sampling_seed"] = continuation_seed(params["sampling_seed"], index, done)
    return out


CONTINUED = 1 << 62  # continuation seeds lie in [2**62, 2**63); a request's seeds (< 2**31 here) lie below


def continuation_seed(seed: int, index: int, done: int) -> int:
    """The seed of answer ``index``'s part after ``done`` tokens, for a request whose n answers take seeds
    seed + j: never one of those (it is at least 2**62), never a replay of an earlier part, and distinct for
    every (index < 2**22, done < 2**40) of the request (a per-request hash plus a distinct offset, mod 2**62)."""
    return CONTINUED + (_mix64(seed) + (index << 40) + done) % CONTINUED


def _mix64(x: int) -> int:
    """splitmix64's finalizer: requests with nearby seeds get unrelated bases."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def generate_group(
    client,
    prompt: list[int],
    params: dict,
    max_parts: int = 1000,
    *,
    min_version: int | None = None,
    stop=None,
) -> list[PartialAnswer]:
    """params["n"] answers to `prompt` on one server, each continued after interruptions until it ends.
    ``min_version``: see `from_response`; ``stop``: a threading.Event that gives up requests still waiting for
    admission (`GenClient.generate`)."""

    def ask(ids: list[int], p: dict) -> list[PartialAnswer]:
        return answers_of(client, client.generate([ids], p, stop=stop), ids, p, min_version)

    answers = ask(prompt, params)
    if not any(a.interrupted for a in answers):
        return answers
    with ThreadPoolExecutor(len(answers)) as pool:  # interrupted answers continue side by side
        return list(pool.map(lambda ia: finish(ask, prompt, params, *ia, max_parts), enumerate(answers)))


def finish(ask, prompt: list[int], params: dict, index: int, answer: PartialAnswer, max_parts: int):
    """`answer` continued until it ends by stop or length; ``ask(ids, params)`` generates one part."""
    while answer.interrupted and len(answer.output_ids) < params["max_new_tokens"]:
        if answer.n_parts >= max_parts:
            raise RuntimeError(f"an answer was interrupted {max_parts} times; is the server restarting?")
        (part,) = ask(prompt + list(answer.output_ids), continuation_params(params, answer, index))
        answer = extend(answer, part)
    return replace(answer, finish="length") if answer.interrupted else answer  # interrupted at the budget
