"""The models a trainer rank hosts: a causal LM (actor, ref) or a value model (critic), loaded and saved as
Hugging Face directories.

The value model is the LM's base transformer plus a scalar head. Its head starts at zero, so a fresh critic
predicts 0 everywhere, the baseline the actor uses without a critic; a directory saved by ``save_hf`` keeps the
trained head in ``value_head.safetensors`` beside the base weights and is loaded back with it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

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
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype, **kwargs) -> ValueModel:
        """The base of the (LM or value model) directory ``path``, with its saved head if it has one."""
        model = cls(AutoModel.from_pretrained(path, dtype=dtype, **kwargs))
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            model.value_head.load_state_dict(load_file(head))
        return model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def load_model(
    path: str | Path, dtype: torch.dtype, critic: bool = False, attention: str | None = None
) -> nn.Module:
    """The causal LM (or, with ``critic``, the value model) of the HF directory ``path`` in ``dtype``, with
    attention implementation ``attention`` (transformers' default when None)."""
    kwargs = {"attn_implementation": attention} if attention else {}
    if critic:
        return ValueModel.from_pretrained(path, dtype, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)


def enable_checkpointing(model: nn.Module, layers: int | None = None) -> None:
    """Recompute activations in the backward pass: of the first ``layers`` decoder layers (None: all)."""
    base = model.base if isinstance(model, ValueModel) else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5's name first, then the older one
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recompute_layers(model, layers)


def recompute_layers(model: nn.Module, layers: int | None) -> None:
    """Of a checkpointed model, the first ``layers`` decoder layers recompute their activations (None: all),
    the others keep them: less recomputation for more memory."""
    blocks = decoder_layers(model)
    if layers is not None and layers > len(blocks):
        raise ValueError(f"recompute_layers {layers}: the model has {len(blocks)} decoder layers")
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = layers is None or i < layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in order: the blocks transformers can checkpoint."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_pointwise(net: nn.Module) -> None:
    """Compile the norms and MLPs (on CUDA): their chains of elementwise ops fuse, and the activations saved
    for backward shrink to the matmuls' inputs. Dynamic shapes: every micro-batch has another length."""
    for module in net.modules():
        if type(module).__name__.endswith(("RMSNorm", "MLP")):
            module.compile(dynamic=True)


def copy_tokenizer(src_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer files of ``src_dir`` (those it has) into ``out_dir``."""
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, out_dir / name)
