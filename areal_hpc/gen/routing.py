"""Routing replay, the rollout side (issue 33): the experts each token of a mixture-of-experts model went to on
the generation server, kept with its sample so that the trainer routes it alike (a trainer that routes on its
own sends tokens to other experts than the ones that sampled them, and RL on MoE models collapses).

The server contract (SGLang 0.5.10, `layers/moe/routed_experts_capturer.py`; the built-in server speaks it too):
a server launched with `--enable-return-routed-experts` answers a /generate request whose top-level field
`return_routed_experts` is true with `meta_info["routed_experts"]`, base64 of a little-endian int32 array
[prompt_len + output_len - 1, num_hidden_layers, num_experts_per_tok]: for every token that went through a
forward pass (each prompt token, each output token but the last) the experts each layer's router chose, zeros
on dense layers. n > 1 answers a list, each answer with its own. A server that ignores the field answers
without it; that fails the rollout here, naming the server and the flag.

How it travels: `group_params` puts the routing's `Shape` (from the actor's config.json) into a group's params
under `client.ROUTED_EXPERTS`; the client sends the request field for it; `decode` turns each answer's routing
into [rows, layers, top_k] of `Shape.dtype` (uint8 for at most 256 experts, else int16: 1-2 bytes per expert
id); an answer keeps the routing of the LAST request that produced its tokens (a continued or multi-turn
request's prompt is the whole sequence so far, so it covers every earlier token); `fit` gives a sequence of T
tokens T rows, zeros where the last request forwarded no token (its last output token, context after it). The
batch key is `BATCH_KEY`, aligned with packed_input_ids.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from areal_hpc.config import moe_experts
from areal_hpc.data import ROUTED_EXPERTS as ROUTED_EXPERTS_KEY
from areal_hpc.gen.client import ROUTED_EXPERTS, GenServerError

BATCH_KEY = ROUTED_EXPERTS_KEY
UINT8_EXPERTS = 256  # expert ids 0..255 fit a byte


@dataclass(frozen=True)
class Shape:
    """What one token's routing holds: `top_k` expert ids for each of `layers`, out of `experts`."""

    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.experts <= UINT8_EXPERTS else np.int16)

    def param(self) -> dict:
        """As it travels in a group's params (JSON: the journals hash the params)."""
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts}


def model_shape(model_path: str) -> Shape:
    """The routing of the model at `model_path`, as SGLang captures it: num_hidden_layers x num_experts_per_tok
    of its (text) config. A dense model has none: ValueError (validation refuses router_replay for it)."""
    return _shape_of_file(str(Path(model_path).expanduser() / "config.json"))


@functools.cache  # a group's params are made for every group; the model's config.json does not change
def _shape_of_file(config_file: str) -> Shape:
    hf = json.loads(Path(config_file).read_text())
    hf = hf.get("text_config", hf)  # a multimodal config: its language model's, as SGLang's hf_text_config
    experts = moe_experts(hf)
    if not experts or not hf.get("num_experts_per_tok"):
        raise ValueError(
            f"{config_file} is a dense model (no experts): routing replay needs a mixture of experts"
        )
    return Shape(int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"]), experts)


def shape_of(params: Mapping) -> Shape | None:
    """The routing a request's params ask for; None when they ask for none."""
    asked = params.get(ROUTED_EXPERTS)
    return Shape(**asked) if asked else None


def decode(response: Mapping, prompt_len: int, shape: Shape, where: str) -> np.ndarray | None:
    """The routing of one /generate answer to a prompt of `prompt_len` ids, [rows, layers, top_k] of
    shape.dtype; None for an answer without tokens (a request aborted while queued ran no forward pass). A
    missing or misshapen routing raises GenServerError naming the server (`where`)."""
    n_out = len(response["output_ids"])
    encoded = response["meta_info"].get("routed_experts")
    if encoded is None:
        if n_out == 0:
            return None
        raise GenServerError(
            where, "/generate", 200,
            "asked for return_routed_experts (actor.router_replay rollout), the answer has no "
            "meta_info.routed_experts: launch the server with --enable-return-routed-experts (the built-in "
            "server: enable_return_routed_experts)",
        )  # fmt: skip
    rows = prompt_len + n_out - 1
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if flat.size != rows * shape.layers * shape.top_k:
        raise GenServerError(
            where, "/generate", 200,
            f"routed_experts holds {flat.size} expert ids, not {rows} tokens x {shape.layers} layers x "
            f"top {shape.top_k} (a prompt of {prompt_len} ids, {n_out} output ids): another model?",
        )  # fmt: skip
    if flat.size and not 0 <= int(flat.min()) <= int(flat.max()) < shape.experts:
        raise GenServerError(
            where, "/generate", 200,
            f"routed_experts holds expert ids {int(flat.min())}..{int(flat.max())}, outside the model's "
            f"{shape.experts} experts",
        )  # fmt: skip
    return flat.reshape(rows, shape.layers, shape.top_k).astype(shape.dtype)


def fit(routing: np.ndarray, n_tokens: int) -> np.ndarray:
    """`routing` of exactly `n_tokens` rows: cut, or padded with zeros for tokens it has no forward of."""
    out = np.zeros((n_tokens, *routing.shape[1:]), dtype=routing.dtype)
    n = min(n_tokens, len(routing))
    out[:n] = routing[:n]
    return out


def packed(routings: Sequence[np.ndarray | None], lengths: Sequence[int]) -> np.ndarray | None:
    """The batch array of sequences of `lengths` tokens with these routings; None when none has one."""
    if all(r is None for r in routings):
        return None
    if any(r is None for r in routings):
        missing = sum(r is None for r in routings)
        raise ValueError(f"{missing} of {len(routings)} sequences have no routing: routing replay needs all")
    return np.concatenate([fit(r, n) for r, n in zip(routings, lengths, strict=True)])
