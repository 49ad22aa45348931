"""The decoder the engine runs: Qwen2, Qwen3, Llama, Qwen2-MoE and Qwen3-MoE from their Hugging Face configs
and safetensors (the experts of the mixtures: ``moe.py``).

The weights live in a few fused tensors per layer (q/k/v in one, gate/up in one: one matrix product each), and
every Hugging Face name is a view into them, so a weight update by name writes straight into what a captured
CUDA graph reads. The arithmetic follows transformers' modelling code step for step (RMSNorm in float32, RoPE
tables from the model's own rotary class), so the logprobs agree with a trainer's forward of the same weights.
Tokens are packed: a forward takes [T] tokens of any rows, with their positions; attention and the KV cache
are the runner's (``runner.py``), passed in as ``attend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig

from areal_hpc.gen.backends.builtin.lora import SidePath
from areal_hpc.gen.backends.builtin.moe import Experts, MoeShape, layer_shapes, layer_views


@dataclass(frozen=True)
class Arch:
    """What differs between the supported families."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def arch_of(config) -> Arch:
    """The family of ``config``; a clear error for any other model."""
    kind = config.model_type
    if getattr(config, "layer_types", None) and set(config.layer_types) != {"full_attention"}:
        raise ValueError(f"the built-in generation server supports full-attention models only, got {kind}")
    if kind == "qwen2":
        return Arch(qkv_bias=True, o_bias=False, qk_norm=False)
    if kind == "qwen2_moe":
        return Arch(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, qk_norm=False)
    if kind in ("qwen3", "llama", "qwen3_moe"):
        if getattr(config, "mlp_bias", False):
            raise ValueError(f"{kind} with mlp_bias is not supported by the built-in generation server")
        bias = bool(getattr(config, "attention_bias", False))
        return Arch(qkv_bias=bias, o_bias=bias, qk_norm=kind != "llama")
    raise ValueError(
        f"the built-in generation server runs qwen2, qwen3 and llama models, not {kind!r} "
        "(and of mixtures of experts, qwen2_moe and qwen3_moe)"
    )


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    tied: bool
    moe: MoeShape | None = None  # None: a dense model

    @classmethod
    def of(cls, config) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, head_dim, config.vocab_size,
            config.rms_norm_eps, bool(getattr(config, "tie_word_embeddings", False)), MoeShape.of(config),
        )  # fmt: skip

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.sparse[layer]

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V one token adds to the cache, over every layer (times the dtype's size)."""
        return self.layers * 2 * self.kv_heads * self.head_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in float32, the product in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, D] (the half-rotation layout of Llama and Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual sum and its RMSNorm (one fused kernel when compiled)."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


# On a GPU the elementwise steps of a layer are compiled: a decode step of a small batch is a chain of tiny
# kernels, and fusing them cuts a layer's launches from ~36 to ~12. Off: eager (as on CPUs).
COMPILE_ON_GPU = True


def _kernels(device: torch.device) -> tuple:
    fns = (rms_norm, rope, add_norm, silu_mul)
    if device.type != "cuda" or not COMPILE_ON_GPU:
        return fns
    return tuple(torch.compile(fn, dynamic=True, fullgraph=True) for fn in fns)


def rope_tables(config, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin [length, head_dim] from the model's own rotary class (every RoPE scaling it knows)."""
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    rotary = rotary_cls(config=config).to(device)
    positions = torch.arange(length, device=device)[None]
    cos, sin = rotary(torch.empty(0, device=device, dtype=dtype), positions)
    return cos[0], sin[0]


# attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]: writes k/v to the cache and attends.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Decoder:
    """The weights of one model and its forward pass over packed tokens."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        self.config, self.arch, self.shape = config, arch_of(config), Shape.of(config)
        self.device, self.dtype = device, dtype
        self.params: dict[str, torch.Tensor] = {}
        self.allocate()
        cos, sin = rope_tables(config, config.max_position_embeddings, device, dtype)
        self.cos, self.sin = cos, sin
        self._norm, self._rope, self._add_norm, self._silu_mul = _kernels(device)
        moe = self.shape.moe
        # Eager silu_mul for the experts: they call it with many shapes (and sizes 1, which torch.compile
        # specialises on), so a compiled one would recompile past its limit.
        self.experts = Experts(moe, self.shape.hidden, device, dtype, silu_mul) if moe else None
        self.lora: SidePath | None = None  # adapters (enable_lora): a low-rank side path beside the weights

    def enable_lora(self, max_rank: int, targets: tuple[str, ...]) -> None:
        """Make room for adapters up to ``max_rank`` on ``targets`` (before any CUDA graph is captured)."""
        self.lora = SidePath(self, max_rank, targets)

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, dtype: torch.dtype) -> Decoder:
        decoder = cls(AutoConfig.from_pretrained(path), device, dtype)
        decoder.load(path)
        return decoder

    # --- weights -------------------------------------------------------------------------------------------

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        s, a = self.shape, self.arch
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        shapes = {"embed": (s.vocab, s.hidden), "norm": (s.hidden,)}
        if not s.tied:
            shapes["lm_head"] = (s.vocab, s.hidden)
        for i in range(s.layers):
            layer = {
                "in_norm": (s.hidden,),
                "qkv": (q + 2 * kv, s.hidden),
                "o": (s.hidden, q),
                "post_norm": (s.hidden,),
            }
            if s.sparse(i):
                layer |= layer_shapes(s.moe, s.hidden)
            else:
                layer |= {"gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}
            if a.qkv_bias:
                layer["qkv_bias"] = (q + 2 * kv,)
            if a.o_bias:
                layer["o_bias"] = (s.hidden,)
            if a.qk_norm:
                layer["q_norm"] = layer["k_norm"] = (s.head_dim,)
            shapes.update({f"{i}.{k}": v for k, v in layer.items()})
        return shapes

    def allocate(self) -> None:
        """(Re)take the weights' memory; their values are undefined until ``load`` or a copy by name."""
        self.params = {n: torch.empty(shape, device=self.device, dtype=self.dtype) for n, shape in self._shapes().items()}  # fmt: skip
        self._named, self._covers = None, {}

    def release(self) -> None:
        """Give the weights' memory back (``allocate`` takes it again)."""
        self.params = {n: torch.empty(0, device=self.device, dtype=self.dtype) for n in self.params}
        self._named, self._covers = None, {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.params.values())

    def named(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> a view into the fused weights (tied names share the embedding; experts come
        under their per-expert names and under the fused names of transformers' state dict)."""
        if self._named is None:
            self._named = self._views()
        return self._named

    def _views(self) -> dict[str, torch.Tensor]:
        s, p = self.shape, self.params
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        views = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"]}
        views["lm_head.weight"] = p["embed"] if s.tied else p["lm_head"]
        for i in range(s.layers):
            at, mlp, pre = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"{i}."
            qkv = p[pre + "qkv"].split([q, kv, kv])
            views |= {at + f"{n}_proj.weight": t for n, t in zip("qkv", qkv, strict=True)}
            views[at + "o_proj.weight"] = p[pre + "o"]
            if s.sparse(i):
                experts, covers = layer_views(s.moe, p, pre, mlp)
                views |= experts
                self._covers |= covers
            else:
                gate_up = p[pre + "gate_up"].chunk(2)
                views |= {mlp + "gate_proj.weight": gate_up[0], mlp + "up_proj.weight": gate_up[1]}
                views[mlp + "down_proj.weight"] = p[pre + "down"]
            views[f"model.layers.{i}.input_layernorm.weight"] = p[pre + "in_norm"]
            views[f"model.layers.{i}.post_attention_layernorm.weight"] = p[pre + "post_norm"]
            if self.arch.qkv_bias:
                bias = p[pre + "qkv_bias"].split([q, kv, kv])
                views |= {at + f"{n}_proj.bias": t for n, t in zip("qkv", bias, strict=True)}
            if self.arch.o_bias:
                views[at + "o_proj.bias"] = p[pre + "o_bias"]
            if self.arch.qk_norm:
                views |= {at + "q_norm.weight": p[pre + "q_norm"], at + "k_norm.weight": p[pre + "k_norm"]}
        return views

    def load(self, path: str) -> None:
        """Copy every weight of the safetensors files in ``path`` into place; an error names what is missing,
        unknown or of another shape, before anything is copied."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        named, seen = self.named(), {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    shape = tuple(f.get_slice(name).get_shape())
                    if name not in named:
                        raise KeyError(f"{file.name}: the model has no weight named {name}")
                    if shape != tuple(named[name].shape):
                        raise ValueError(f"{file.name}: {name} has shape {shape}, the model's is {tuple(named[name].shape)}")  # fmt: skip
                    seen[name] = file
        missing = sorted(self._required() - set(seen) - {n for f in seen for n in self._covers.get(f, ())})
        if missing:
            raise KeyError(f"{path}: no weights for {missing[:5]} ({len(missing)} missing)")
        with torch.no_grad():
            for file in files:
                with safe_open(file, framework="pt", device=str(self.device)) as f:
                    for name in f.keys():  # noqa: SIM118
                        named[name].copy_(f.get_tensor(name))

    def _required(self) -> set[str]:
        """The names a checkpoint must hold: all but the tied head and the fused names of the experts (a
        checkpoint holds the per-expert names, or a fused name that covers them)."""
        named = self.named()
        return set(named) - set(self._covers) - ({"lm_head.weight"} if self.shape.tied else set())

    # --- forward -------------------------------------------------------------------------------------------

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend, last: torch.Tensor | None = None,
        static: bool = False, record: torch.Tensor | None = None, rotates: bool = False,
    ):  # fmt: skip
        """Logits [T or len(last), V] of packed tokens ``ids`` [T] at ``positions`` [T]; ``last`` picks the
        tokens whose logits are wanted (a prefill's last prompt tokens). ``static``: fixed shapes and no host
        sync (a decode step, CUDA graphs); ``record`` [T, layers, k] (int32) takes each sparse layer's choice of
        experts. ``rotates``: ``attend`` applies the rotary embedding itself (the decode kernel fuses it with the
        cache write), so q and k reach it unrotated."""
        s, p = self.shape, self.params
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        norm, add_norm = self._norm, self._add_norm
        x = F.embedding(ids, p["embed"])
        cos, sin = (None, None) if rotates else (self.cos[positions], self.sin[positions])
        h = norm(x, p["0.in_norm"], s.eps)
        for i in range(s.layers):
            pre = f"{i}."
            qkv = self._linear(h, pre + "qkv", p.get(pre + "qkv_bias"))
            q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
            q, k = q.view(-1, s.heads, s.head_dim), k.view(-1, s.kv_heads, s.head_dim)
            if self.arch.qk_norm:
                q, k = norm(q, p[pre + "q_norm"], s.eps), norm(k, p[pre + "k_norm"], s.eps)
            if not rotates:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            out = attend(i, q, k, v.view(-1, s.kv_heads, s.head_dim))
            out = self._linear(out.reshape(-1, q_size), pre + "o", p.get(pre + "o_bias"))
            x, h = add_norm(x, out, p[pre + "post_norm"], s.eps)
            if s.sparse(i):
                delta = self.experts.forward(p, pre, h, static, None if record is None else record[:, i])
            else:
                delta = self._linear(self._silu_mul(self._linear(h, pre + "gate_up")), pre + "down")
            # The residual sum and the next norm (the next layer's input norm, or the final one) in one.
            x, h = add_norm(x, delta, p[f"{i + 1}.in_norm"] if i + 1 < s.layers else p["norm"], s.eps)
        if last is not None:
            h = h[last]
        return F.linear(h, p["embed"] if s.tied else p["lm_head"])

    def _linear(self, h: torch.Tensor, key: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Fused weight ``key``'s product with ``h``, and its adapter's when it has one."""
        out = F.linear(h, self.params[key], bias)
        side = self.lora.delta(key, h) if self.lora is not None else None
        return out if side is None else out + side
