"""The models a trainer rank hosts: a causal LM (actor, ref) or a value model (critic), loaded and saved as
Hugging Face directories.

The value model is the LM's base transformer plus a scalar head. Its head starts at zero, so a fresh critic
predicts 0 everywhere, the baseline the actor uses without a critic; a directory saved by ``save_hf`` keeps the
trained head in ``value_head.safetensors`` beside the base weights and is loaded back with it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

VALUE_HEAD_FILE = "value_head.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class ValueModel(nn.Module):
    """A base transformer and a linear head: ``forward`` gives one value per token, ``[n, max_len]``."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.value_head = nn.Linear(base.config.hidden_size, 1, dtype=base.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype) -> ValueModel:
        """The base of the (LM or value model) directory ``path``, with its saved head if it has one."""
        model = cls(AutoModel.from_pretrained(path, dtype=dtype))
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            model.value_head.load_state_dict(load_file(head))
        return model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def load_model(path: str | Path, dtype: torch.dtype, critic: bool = False) -> nn.Module:
    """The causal LM (or, with ``critic``, the value model) of the HF directory ``path`` in ``dtype``."""
    if critic:
        return ValueModel.from_pretrained(path, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (transformers 5 name first, then the older one)."""
    base = model.base if isinstance(model, ValueModel) else model
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _cast_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # Cast each storage once, so tied weights stay one tensor and save_pretrained still drops the duplicate.
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in cast:
            cast[key] = tensor.detach().to(dtype)
        out[name] = cast[key]
    return out


def save_model(model: nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """Write ``model`` into ``out_dir`` as an HF directory (safetensors) with weights in ``dtype``."""
    if isinstance(model, ValueModel):
        model.base.save_pretrained(out_dir, state_dict=_cast_state_dict(model.base, dtype))
        save_file(_cast_state_dict(model.value_head, dtype), out_dir / VALUE_HEAD_FILE)
    else:
        model.save_pretrained(out_dir, state_dict=_cast_state_dict(model, dtype))
    # save_pretrained records the parameters' dtype; the files hold `dtype`.
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):  # transformers 5 and 4 spellings
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def copy_tokenizer(src_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer files of ``src_dir`` (those it has) into ``out_dir``."""
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, out_dir / name)
