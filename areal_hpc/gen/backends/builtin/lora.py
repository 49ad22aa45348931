"""LoRA on the built-in engine: one adapter at a time, as a low-rank side path beside the base weights.

Each adapted fused linear of a layer (qkv, o, gate_up, down) gets two buffers made at start for the largest
rank the server takes (SGLang's ``--max-lora-rank``): A [parts * R, in] and B [out, parts * R], one block per
HF module it fuses (q, k, v; gate, up), the scale alpha / r folded into B. The forward adds x A^T B^T to the
base product: exactly W + scale B A, without touching W, so adapters come and go with no rounding drift in
the base and no second copy of it. Loading an adapter copies into the buffers in place (captured CUDA
graphs read them); none loaded, they are zero. A module outside ``targets`` has no buffers and costs nothing.

Why not merge into W: merging costs nothing per step, but taking an adapter back out exactly needs the base
kept aside (a second copy of the adapted weights), or it accumulates bf16 rounding at every version. The side
path costs two rank-R products per adapted linear per step; its cost on a GPU is still to be measured.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from areal_hpc.weights import Adapter, AdapterError, read_adapter

# HF module (the last part of its name) -> the fused weight it is a block of, and its block's index there.
FUSED = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}  # fmt: skip
ALL = tuple(FUSED)  # SGLang's --lora-target-modules all, as far as this engine's models have them


class SidePath:
    """The adapter buffers of a decoder (see the module's docstring)."""

    def __init__(self, decoder, max_rank: int, targets: tuple[str, ...]):
        unknown = sorted(set(targets) - set(FUSED))
        if unknown or max_rank < 1:
            raise ValueError(
                f"LoRA on the built-in engine: target modules {unknown} are not among {list(FUSED)}"
                if unknown else f"LoRA on the built-in engine needs --max-lora-rank >= 1, got {max_rank}"
            )  # fmt: skip
        s = decoder.shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        # Each fused weight's blocks: (rows of its output, columns of its input) per part.
        blocks = {
            "qkv": ([q, kv, kv], s.hidden), "o": ([s.hidden], q),
            "gate_up": ([s.intermediate, s.intermediate], s.hidden), "down": ([s.hidden], s.intermediate),
        }  # fmt: skip
        self.max_rank, self.targets, self.blocks = max_rank, tuple(targets), blocks
        fused = {FUSED[t][0] for t in targets}
        self.ab: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(s.layers):
            for kind in sorted(fused):
                if kind in ("gate_up", "down") and s.sparse(i):
                    continue  # a mixture's experts take no adapter here
                rows, cols = blocks[kind]
                width = len(rows) * max_rank
                zeros = dict(device=decoder.device, dtype=decoder.dtype)
                self.ab[f"{i}.{kind}"] = (
                    torch.zeros(width, cols, **zeros),
                    torch.zeros(sum(rows), width, **zeros),
                )

    def delta(self, key: str, h: torch.Tensor) -> torch.Tensor | None:
        """The side path's addition to fused linear ``key``'s output for inputs ``h``; None: not adapted."""
        ab = self.ab.get(key)
        return None if ab is None else F.linear(F.linear(h, ab[0]), ab[1])

    def check(self, adapter: Adapter, where: str) -> dict[str, tuple[str, int]]:
        """Where each of ``adapter``'s modules goes (buffer key, block); AdapterError naming ``where`` for one
        of a rank or module this server was not started for."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{where}: rank {adapter.rank} is above this server's --max-lora-rank {self.max_rank}")  # fmt: skip
        placed = {}
        for module in adapter.pairs:
            parts = module.split(".")
            own = parts[-1]
            layer = parts[2] if len(parts) == 5 and parts[:2] == ["model", "layers"] else None
            if own not in self.targets or layer is None or not layer.isdigit():
                raise AdapterError(
                    f"{where}: adapts {module}, which this server does not take (--lora-target-modules "
                    f"{' '.join(self.targets)}; model.layers.<i>.<self_attn|mlp>.<module>)"
                )
            kind, block = FUSED[own]
            key = f"{int(layer)}.{kind}"
            if key not in self.ab:
                raise AdapterError(
                    f"{where}: adapts {module}, which this model does not have (or is an expert)"
                )
            a, b = adapter.pairs[module]
            rows, cols = self.blocks[kind]
            if tuple(a.shape) != (adapter.rank, cols) or tuple(b.shape) != (rows[block], adapter.rank):
                raise AdapterError(
                    f"{where}: {module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; this model needs "
                    f"[{adapter.rank}, {cols}] and [{rows[block]}, {adapter.rank}]"
                )
            placed[module] = (key, block)
        return placed

    @torch.no_grad()
    def load(self, adapter: Adapter, placed: dict[str, tuple[str, int]]) -> None:
        """Copy ``adapter`` (checked: ``placed``) into the buffers, every other block zero."""
        self.clear()
        for module, (key, block) in placed.items():
            a, b = adapter.pairs[module]
            buf_a, buf_b = self.ab[key]
            rows = self.blocks[key.split(".")[1]][0]
            r, start, top = adapter.rank, block * self.max_rank, sum(rows[:block])
            buf_a[start : start + r].copy_(a)
            buf_b[top : top + rows[block], start : start + r].copy_(b.float() * adapter.scale)

    @torch.no_grad()
    def clear(self) -> None:
        for a, b in self.ab.values():
            a.zero_()
            b.zero_()


class Adapters:
    """The adapters a server knows by name (SGLang's /load_lora_adapter, /unload_lora_adapter) and the one in
    its side path. This engine holds one at a time: the last loaded. A request may name any name still
    loaded and runs on that one (as a request paused across a full-weight update goes on under the new
    weights); unloading it unloads the names that ran on it too. ``at_step(fn)`` runs ``fn`` on the engine
    thread between two steps, with the cache flushed."""

    def __init__(self, side: SidePath | None, at_step: Callable[[Callable[[], None]], None]):
        self.side, self.at_step = side, at_step
        self.loaded: dict[str, str] = {}  # name -> folder, oldest first; the last one is in the side path
        self._lock = threading.Lock()  # one change at a time (HTTP threads); requests read a snapshot

    def load(self, name: str, path: str, device: torch.device) -> dict[str, str]:
        side = self._enabled()
        with self._lock:
            if name in self.loaded:
                raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            adapter = read_adapter(path, device)  # off the engine thread: generation goes on meanwhile
            placed = side.check(adapter, path)
            self.at_step(lambda: side.load(adapter, placed))
            self.loaded = {**self.loaded, name: path}
            return dict(self.loaded)

    def unload(self, name: str) -> dict[str, str]:
        side = self._enabled()
        with self._lock:
            if name not in self.loaded:
                raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded)}")
            if name == list(self.loaded)[-1]:
                self.at_step(side.clear)
                self.loaded = {}
            else:
                self.loaded = {n: p for n, p in self.loaded.items() if n != name}
            return dict(self.loaded)

    def check_request(self, name: str | None) -> None:
        """A request may name a loaded adapter, or none while none is loaded (the base model)."""
        loaded = self.loaded
        if name is None and loaded:
            raise AdapterError(
                f"this server serves LoRA adapter {list(loaded)[-1]}: a request names it (lora_path)"
            )
        if name is not None and name not in loaded:
            why = "LoRA is not enabled (--enable-lora)" if self.side is None else f"loaded: {list(loaded)}"
            raise AdapterError(f"Got LoRA adapter that has never been loaded: {name} ({why})")

    def _enabled(self) -> SidePath:
        if self.side is None:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self.side
