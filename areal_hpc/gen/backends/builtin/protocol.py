"""SGLang's ``/generate`` request and response format: parsing with errors that name the field, and output JSON.

Sampling parameters the built-in server does not implement are refused unless they hold their neutral value
(AReaL sends frequency_penalty 0), so a client never believes a setting took effect when it did not; top-level
fields it does not use are ignored, as SGLang ignores them.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from areal_hpc.config import MAX_STOP_TOKEN_IDS


class RequestError(ValueError):
    """A client error in a request; ``field`` names the offending field (None when no single field)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


# SGLang's sampling parameters that change nothing at these values: accepted so, refused otherwise.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0}
CONSTRAINED = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's grammars; refused by name here


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters that the built-in server supports (defaults are SGLang's)."""

    max_new_tokens: int | None = 128  # None: until the context length
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    sampling_seed: int | None = None  # None: drawn from the server's seeded generator
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, raw: Any, where: str = "sampling_params") -> SamplingParams:
        """Validate a JSON ``sampling_params`` object."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise RequestError(where, f"must be an object, got {type(raw).__name__}")
        stop = raw.get("stop")
        if stop not in (None, [], ""):
            raise RequestError(f"{where}.stop", "stop strings are not supported here; use stop_token_ids")
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__) - {"stop"} - set(NEUTRAL))
        if constrained := [key for key in unknown if key in CONSTRAINED]:
            raise RequestError(f"{where}.{constrained[0]}", "constrained decoding is not served by the built-in "
                               "engine (SGLang serves it: allocation_mode sglang.<spec>)")  # fmt: skip
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", "unsupported sampling parameter")
        for key, neutral in NEUTRAL.items():
            if key in raw and raw[key] != neutral:
                raise RequestError(f"{where}.{key}", f"not implemented here; only {neutral} is accepted")
        f = _Fields(raw, where)
        params = cls(
            max_new_tokens=f.integer("max_new_tokens", 128, minimum=0, nullable=True),
            min_new_tokens=f.integer("min_new_tokens", 0, minimum=0),
            temperature=f.number("temperature", 1.0, minimum=0.0),
            top_p=f.number("top_p", 1.0, minimum=0.0),
            top_k=f.integer("top_k", -1, minimum=-1),
            stop_token_ids=tuple(f.token_ids("stop_token_ids")),
            n=f.integer("n", 1, minimum=1),
            ignore_eos=f.boolean("ignore_eos", False),
            sampling_seed=f.integer("sampling_seed", None, minimum=0, nullable=True),
            skip_special_tokens=f.boolean("skip_special_tokens", True),
        )
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"{where}.stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}",
            )
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError(f"{where}.top_p", f"must be in (0, 1], got {params.top_p}")
        if params.top_k == 0:
            raise RequestError(f"{where}.top_k", "must be -1 (no limit) or >= 1, got 0")
        return params


class _Fields:
    """Typed reads of one JSON object's fields, each error naming ``where.key``."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def _fail(self, key: str, expected: str) -> RequestError:
        return RequestError(f"{self.where}.{key}", f"must be {expected}, got {self.raw[key]!r}")

    def integer(self, key: str, default: int | None, minimum: int, nullable: bool = False) -> int | None:
        value = self.raw.get(key, default)
        if value is None and (nullable or default is None):
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self._fail(key, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, minimum: float) -> float:
        value = self.raw.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < minimum:
            raise self._fail(key, f"a number >= {minimum}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def token_ids(self, key: str) -> list[int]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(_is_token(t) for t in value):
            raise self._fail(key, "a list of token ids")
        return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class GenerateInput:
    """A parsed ``/generate`` body: prompts as token ids; rid one string for all, one per prompt, or None."""

    prompts: list[list[int]]
    rid: str | list[str] | None
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool
    return_routed_experts: bool  # honoured only by a server that records them (SGLang's contract)
    batched: bool  # answer with a list (a list of prompts, or n > 1) rather than one object
    lora_path: str | None = None  # the adapter it names (SGLang: its lora_name); None: the base model


def parse_generate(body: Any, encode: Callable[[str], list[int]] | None) -> GenerateInput:
    """Validate a ``/generate`` body; ``encode`` tokenizes ``text`` (None when the server has no tokenizer)."""
    if not isinstance(body, dict):
        raise RequestError(None, "the body must be a JSON object")
    # Other top-level fields (image_data, ...) are ignored, as SGLang ignores what it does not use;
    # unknown sampling params are refused (SamplingParams), as SGLang refuses them.
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the built-in server")
    prompts, listed = _prompts(body, encode)
    params = SamplingParams.from_dict(body.get("sampling_params"))
    f = _Fields(body, "body")
    return GenerateInput(
        prompts=prompts,
        rid=_rid(body.get("rid"), len(prompts)),
        params=params,
        return_logprob=f.boolean("return_logprob", False),
        return_text_in_logprobs=f.boolean("return_text_in_logprobs", False),
        return_routed_experts=f.boolean("return_routed_experts", False),
        batched=listed or params.n > 1,
        lora_path=_lora_path(body.get("lora_path"), len(prompts)),
    )


def _lora_path(value: Any, n_prompts: int) -> str | None:
    """SGLang's lora_path: one adapter name, or one per prompt; this server holds one adapter at a time, so
    a list must name one adapter throughout."""
    names = value if isinstance(value, list) else [value]
    if isinstance(value, list) and len(value) != n_prompts:
        raise RequestError(
            "lora_path", f"a list must name one adapter per prompt ({n_prompts}), got {len(value)}"
        )
    if not all(n is None or (isinstance(n, str) and n) for n in names):
        raise RequestError(
            "lora_path", "must be an adapter's name (a non-empty string), null, or a list of them"
        )
    if len(set(names)) > 1:
        raise RequestError("lora_path", f"names several adapters {sorted(set(map(str, names)))}; this server runs one at a time")  # fmt: skip
    return names[0] if names else None


def _prompts(body: dict, encode: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
    """The prompts as token ids and whether they came as a list of prompts."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and text is not None:
        raise RequestError("input_ids", "give input_ids or text, not both")
    if ids is None and text is None:
        raise RequestError("input_ids", "missing input: give input_ids or text")
    if ids is not None:
        listed = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if listed else [ids]
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not prompt or not all(_is_token(t) for t in prompt):
                where = f"input_ids[{i}]" if listed else "input_ids"
                raise RequestError(where, "must be a non-empty list of token ids (or a list of such lists)")
        return prompts, listed
    if encode is None:
        raise RequestError("text", "this server has no tokenizer; send input_ids")
    listed = isinstance(text, list)
    texts = text if listed else [text]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise RequestError("text", "must be a non-empty string or a list of non-empty strings")
    return [encode(t) for t in texts], listed


def _rid(rid: Any, n_prompts: int) -> str | list[str] | None:
    if rid is None or (isinstance(rid, str) and rid):
        return rid
    if isinstance(rid, list) and len(rid) == n_prompts and all(isinstance(r, str) and r for r in rid):
        return rid
    raise RequestError("rid", f"must be a string or a list of {n_prompts} strings (one per prompt)")


def format_output(
    out: Any,
    decode: Callable[[list[int], bool], str] | None,
    return_logprob: bool,
    return_text_in_logprobs: bool,
) -> dict:
    """One SGLang response object from an engine ``Output``."""
    text_ids = out.output_ids
    if out.finish_reason.get("matched") is not None:  # SGLang trims the matched stop token from the text
        text_ids = text_ids[:-1]
    skip = out.skip_special_tokens
    meta = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        "e2e_latency": out.latency,
    }
    if return_logprob:
        ids = out.output_ids
        texts = [decode([t], False) for t in ids] if return_text_in_logprobs and decode else [None] * len(ids)
        # Tuples (a JSON array each, as lists): the collector stops tracking a tuple of plain values at its first
        # pass, where a rollout's 131k lists were walked by every full collection (tools/bench_answer_json.py:
        # five rollouts formatted, 5 full collections with lists, none with tuples).
        meta["output_token_logprobs"] = list(zip(out.logprobs, ids, texts, strict=True))
    routed = getattr(out, "routed_experts", None)
    if routed is not None:
        meta["routed_experts"] = encode_routed_experts(routed)
    return {"text": decode(text_ids, skip) if decode else "", "output_ids": out.output_ids, "meta_info": meta}


def encode_routed_experts(routed: np.ndarray) -> str:
    """SGLang's wire form of a sample's routed experts [tokens, layers, k]: base64 of the int32 array, little
    endian, flattened (the client reshapes it: it knows the layers and k)."""
    return base64.b64encode(routed.astype("<i4").tobytes()).decode("ascii")
