"""A LoRA adapter on disk in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``, a
manifest last. What the trainer publishes at each version and saves at ``save_freq``, what the generation
servers load (SGLang's and the built-in engine's ``/load_lora_adapter``), what ``export --merge`` folds into
its base model.

The file names each tensor as PEFT does, ``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B``
[out, r]; the adapted weight of ``<module>`` is W + (alpha / r) B A. A folder read here comes from shared
storage: every key, shape and option is checked, and an error names the file and the key.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from areal_hpc.control import MANIFEST, fsio, verify_snapshot, write_manifest

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
A, B = ".lora_A.weight", ".lora_B.weight"
# PEFT options that change what an adapter computes beyond W + (alpha / r) B A: SGLang ignores them, and
# so would every server here. An adapter that sets one is refused rather than served as something else.
UNSUPPORTED = ("use_dora", "use_rslora", "modules_to_save", "lora_bias")


NAME_PREFIX = "policy-v"


def adapter_name(version: int) -> str | None:
    """The name the servers know version ``version``'s adapter by; None for version 0 (the base model)."""
    return f"{NAME_PREFIX}{version}" if version > 0 else None


class AdapterError(ValueError):
    """An adapter folder that cannot be used: the message names the file and what is wrong."""


@dataclass(frozen=True)
class Adapter:
    rank: int
    alpha: float
    base: str  # the base model's path, as the config names it
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # HF module name -> (A [r, in], B [out, r])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> list[str]:
        """The adapted modules' own names (q_proj, ...), as SGLang's --lora-target-modules takes them."""
        return sorted({module.rsplit(".", 1)[-1] for module in self.pairs})


def write_adapter(path: str | Path, adapter: Adapter) -> Path:
    """The adapter as a PEFT folder at ``path``, built aside and renamed into place (a server never reads half
    of one); a folder already there is replaced."""
    from peft import LoraConfig

    path = Path(path)
    tmp = fsio.temporary_dir(path)
    tensors = {}
    for module, (a, b) in adapter.pairs.items():
        tensors[PREFIX + module + A] = a.detach().to("cpu").contiguous()
        tensors[PREFIX + module + B] = b.detach().to("cpu").contiguous()
    save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
    config = LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, target_modules=adapter.targets, bias="none",
        base_model_name_or_path=adapter.base, task_type="CAUSAL_LM",
    )  # fmt: skip
    config.save_pretrained(tmp)
    write_manifest(tmp)
    fsio.move_into_place(tmp, path)
    return path


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter folder names (its config's base_model_name_or_path, checked)."""
    _, _, base = _config(Path(path) / CONFIG)
    if not base:
        raise AdapterError(
            f"{Path(path) / CONFIG}: base_model_name_or_path is not set: which model does it adapt?"
        )
    return base


def read_adapter(path: str | Path, device: str | torch.device = "cpu") -> Adapter:
    """The adapter in folder ``path`` (checked against its manifest when it has one, as every snapshot of
    ours does); AdapterError names the file and key of anything that is not a LoRA adapter we can serve."""
    path = Path(path)
    if (path / MANIFEST).exists():
        verify_snapshot(path)
    rank, alpha, base = _config(path / CONFIG)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{path}: no {WEIGHTS}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(weights, framework="pt", device=str(device)) as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            half = A if key.endswith(A) else B if key.endswith(B) else None
            if half is None or not key.startswith(PREFIX):
                raise AdapterError(f"{weights}: {key!r} is not a LoRA weight (base_model.model.<module>{A} or {B})")  # fmt: skip
            halves.setdefault(key[len(PREFIX) : -len(half)], {})[half] = f.get_tensor(key)
    pairs = {}
    for module, ab in sorted(halves.items()):
        if len(ab) != 2:
            raise AdapterError(f"{weights}: {module} has {next(iter(ab)).strip('.')} without its other half")
        a, b = ab[A], ab[B]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"{weights}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and "
                f"[out, r] with r = {rank} ({CONFIG})"
            )
        pairs[module] = (a, b)
    if not pairs:
        raise AdapterError(f"{weights}: holds no LoRA weights")
    return Adapter(rank, alpha, base, pairs)


def _config(file: Path) -> tuple[int, float, str]:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{file.parent}: no {CONFIG} (not a LoRA adapter folder)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{file}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}, not LORA")  # fmt: skip
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{file}: r is {rank!r}, not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"{file}: lora_alpha is {alpha!r}, not a positive number")
    for key in UNSUPPORTED:
        if config.get(key):
            raise AdapterError(f"{file}: {key} is set; only plain LoRA (W + alpha/r B A) is served")
    return rank, float(alpha), str(config.get("base_model_name_or_path") or "")


def merged(
    weights: Iterable[tuple[str, torch.Tensor]], adapter: Adapter
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF weights with the adapter folded in: each ``<module>.weight`` it adapts as W + scale B A (float32
    arithmetic, W's dtype); an adapted module the weights lack is an error, after the last weight."""
    left = set(adapter.pairs)
    for name, tensor in weights:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in adapter.pairs:
            a, b = adapter.pairs[module]
            if (b.shape[0], a.shape[1]) != tuple(tensor.shape):
                raise AdapterError(f"{module}: the adapter's B A is {b.shape[0]}x{a.shape[1]}, the weight {tuple(tensor.shape)}")  # fmt: skip
            tensor = (tensor.float() + adapter.scale * (b.float() @ a.float())).to(tensor.dtype)
            left.discard(module)
        yield name, tensor
    if left:
        raise AdapterError(f"the adapter adapts modules the model does not have: {sorted(left)[:5]}")


def write_merged(adapter_path: str | Path, out: str | Path) -> Path:
    """The adapter at ``adapter_path`` folded into its base model, an HF folder at ``out`` (built aside and
    renamed into place): the base's files as they are, each safetensors file with its adapted weights merged,
    one file in memory at a time."""
    adapter, out = read_adapter(adapter_path), Path(out)
    base = Path(adapter.base)
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"{adapter_path}: its base {base} holds no *.safetensors files")
    tmp = fsio.temporary_dir(out)
    for item in sorted(base.iterdir()):  # config, tokenizer, index: as they are
        if item.is_file() and item.suffix != ".safetensors" and item.name != MANIFEST:
            shutil.copy2(item, tmp / item.name)
    left = dict(adapter.pairs)
    for file in files:
        tensors = load_file(file)
        mine = Adapter(adapter.rank, adapter.alpha, adapter.base, {m: left.pop(m) for m in list(left) if f"{m}.weight" in tensors})  # fmt: skip
        save_file(dict(merged(tensors.items(), mine)), tmp / file.name, metadata={"format": "pt"})
    if left:
        raise AdapterError(
            f"{adapter_path}: adapts modules its base {base} does not have: {sorted(left)[:5]}"
        )
    write_manifest(tmp)
    fsio.move_into_place(tmp, out)
    return out
