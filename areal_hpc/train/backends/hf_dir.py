"""Write a model as a Hugging Face directory from a stream of its full tensors, shard file by shard file.

Every engine saves through ``write_hf_dir``: the tensors arrive one at a time (a sharded engine gathers each
just before it is yielded, on every rank), rank 0 keeps at most one shard file's worth of them in CPU memory,
and the directory is built under a temporary name, gets a manifest last, and is renamed into place.
A value model's head goes to ``value_head.safetensors`` beside its base's weights (see ``train.models``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from areal_hpc.control import fsio, write_manifest
from areal_hpc.train import dist
from areal_hpc.train.models import VALUE_HEAD_FILE, ValueModel, copy_tokenizer

SHARD_BYTES = 2 * 2**30
INDEX = "model.safetensors.index.json"


def write_hf_dir(
    path: str | Path,
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    source_dir: Path,
    dtype: torch.dtype,
) -> Path | None:
    """Write ``model``'s config and ``weights`` (its state-dict names, full tensors) as an HF directory.

    A collective when ``weights`` is: every rank drains it; rank 0 writes and returns the path, others None.
    """
    if dist.get_rank() != 0:
        for _ in weights:
            pass
        return None
    path = Path(path)
    tmp = fsio.temporary_dir(path)
    critic = isinstance(model, ValueModel)
    base = model.base if critic else model
    head: dict[str, torch.Tensor] = {}
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        if shard:
            name = f"shard{len(set(weight_map.values())) + 1}"  # renamed once the count is known
            save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard.clear()

    size = 0
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        if critic and name.startswith("value_head."):
            head[name.removeprefix("value_head.")] = tensor
            continue
        name = name.removeprefix("base.") if critic else name
        if _tied_duplicate(base, name):
            continue
        if size + tensor.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
    flush()
    _name_shards(tmp, weight_map)
    if head:
        save_file(head, tmp / VALUE_HEAD_FILE)
    _write_config(base, tmp, dtype)
    copy_tokenizer(source_dir, tmp)
    write_manifest(tmp)
    fsio.move_into_place(tmp, path)
    return path


def _name_shards(folder: Path, weight_map: dict[str, str]) -> None:
    """HF's names: one file is ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with an
    index of which tensor is in which."""
    shards = sorted(set(weight_map.values()), key=lambda s: int(s.removeprefix("shard")))
    final = {s: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards, 1)}
    if len(shards) == 1:
        final = {shards[0]: "model.safetensors"}
    for shard, name in final.items():
        os.replace(folder / shard, folder / name)
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": {t: final[s] for t, s in weight_map.items()}}
        (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")


def _tied_duplicate(model: nn.Module, name: str) -> bool:
    # A tied LM head is the embedding: HF loaders re-tie it, so it is written once, as save_pretrained does.
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _write_config(model: nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):  # the files hold `dtype`, whatever the parameters' dtype was
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2) + "\n")
