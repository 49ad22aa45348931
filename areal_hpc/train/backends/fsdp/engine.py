"""FSDPEngine: one model sharded over the data-parallel ranks with FSDP2 (``fully_shard``), run on packed
micro-batches.

- Sharding: each decoder layer is its own FSDP unit, the rest (embeddings, final norm, LM head) the root's.
  Parameters, gradients and AdamW state live as shards (DTensors): a rank holds 1/N of each.
- Precision: float32 master weights; with a lower ``dtype`` the unsharded parameters are cast to it for
  compute and gradients are reduced in float32 (FSDP2's MixedPrecisionPolicy). An inference-only engine
  (ref) keeps its weights in ``dtype``.
- Gradients are SUMMED over ranks (the loss is already divided by the global normaliser), clipped over the
  norm of the whole sharded gradient.
- On CUDA the norms and MLPs are compiled (torch.compile): fused elementwise ops, fewer saved activations.
- Inputs: a micro-batch runs as one packed row (``train.packed``): no padding is computed. The LM's
  logprobs and entropy come from ``train.head`` in chunks of tokens: no ``[T, V]`` logits.
- ``context`` > 1 (allocation_mode's c): the c consecutive ranks of a context group share their micro-batches
  and each runs a slice of every row's tokens (``train.ulysses``); FSDP still shards over every rank.
- Every forward and backward is a collective: a rank with fewer micro-batches than another runs empty
  ones (one token, zero loss), so every rank makes the same calls.
- ``optimizer.offload``: AdamW state lives in CPU memory and is streamed to the device one parameter at a
  time for the update (``offload``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from areal_hpc.algo import align_next_token
from areal_hpc.config import MicroBatchSpec, ModelConfig
from areal_hpc.control import timeline
from areal_hpc.data import CU, select
from areal_hpc.train import dist, lora, ulysses
from areal_hpc.train.backends.fsdp import offload
from areal_hpc.train.backends.hf_dir import write_hf_dir
from areal_hpc.train.backends.recover_state import RecoverState, load_tensors
from areal_hpc.train.head import HEAD_CHUNK_TOKENS, chunked_logprobs
from areal_hpc.train.microbatch import EMPTY_MB, in_packed_order, micro_batch_groups, seq_lengths, to_torch
from areal_hpc.train.models import DTYPES, ValueModel, compile_pointwise, enable_checkpointing, load_model
from areal_hpc.train.numerics import LossFn, clipped_step, make_optimizer, make_schedule
from areal_hpc.train.packed import ATTENTION, packed_kwargs
from areal_hpc.train.ulysses import ContextGroup
from areal_hpc.weights import Adapter, merged, write_adapter


class PackedModel(nn.Module):
    """An HF model on one packed micro-batch -> float32 per-token outputs, token-aligned.

    LM: ``logprobs`` of each token given the previous ones of its sequence, and the ``entropy`` of the
    distribution it was drawn from (0 at each sequence's first token). Value model: ``values``.
    The LM head runs inside this module's forward, where FSDP has its weight unsharded.
    """

    def __init__(
        self, model: nn.Module, chunk_tokens: int = HEAD_CHUNK_TOKENS, context: ContextGroup | None = None
    ):
        super().__init__()
        self.model, self.chunk_tokens, self.context = model, chunk_tokens, context
        self.critic = isinstance(model, ValueModel)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0):
        n, rows = input_ids.shape[0], cu_seqlens
        if self.context is not None:  # this rank's slice of a row that c divides
            rows = ulysses.padded(cu_seqlens, self.context.size)
            input_ids = F.pad(input_ids, (0, int(rows[-1]) - n))
        start, end = self.context.bounds(input_ids.shape[0]) if self.context else (0, n)
        packed, ids = packed_kwargs(rows, self.context), input_ids[None, start:end]
        if self.critic:
            values = self.model(ids, None, use_cache=False, **packed)[0]
            return {"values": self._whole(values.float(), n).clone()}  # not a view: FSDP hooks the output
        hidden = self.model.model(input_ids=ids, use_cache=False, **packed).last_hidden_state[0]
        labels = torch.roll(input_ids, -1)[start:end]  # a sequence's last position predicts garbage, dropped
        logp, entropy = chunked_logprobs(
            hidden, self.model.lm_head.weight, labels, temperature, self.chunk_tokens
        )
        return {
            "logprobs": align_next_token(self._whole(logp, n), cu_seqlens),
            "entropy": align_next_token(self._whole(entropy, n), cu_seqlens),
        }

    def _whole(self, values: torch.Tensor, n: int) -> torch.Tensor:
        """Per-token values of the row's first ``n`` tokens, from this rank's slice of them."""
        return values if self.context is None else ulysses.gather_slices(values, self.context)[:n]


def _shard(net: PackedModel, mp: MixedPrecisionPolicy | None) -> None:
    base = net.model.base if isinstance(net.model, ValueModel) else net.model
    layer_types = tuple(base._no_split_modules or ())  # HF's decoder-layer class names
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for module in net.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, **kwargs)
    fully_shard(net, **kwargs)
    for module in net.modules():  # summed, not averaged, over ranks (with a plain SUM, which gloo has)
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class FSDPEngine(RecoverState):
    """A model (causal LM, or with ``critic`` a value model) sharded over this process group's ranks.

    Arguments as ``TorchEngine``'s, and the ``context`` size of sequence parallelism. Alone (no process
    group), the engine starts a one-rank group itself.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        total_train_steps: int | None = None,
        seed: int = 1,
        *,
        critic: bool = False,
        context: int = 1,
    ):
        if not model_cfg.path:
            raise ValueError("the model config has no path to load the model from")
        dist.init_alone()
        # Without c every rank holds data of its own (dp_group None: all ranks); with it, a context group's.
        self.context, self.dp_group = ulysses.context_groups(context)
        torch.manual_seed(seed)
        self.cfg, self.source_dir = model_cfg, Path(model_cfg.path)
        self.device, self.dtype = dist.default_device(), DTYPES[model_cfg.dtype]
        self.trainable, self.critic = total_train_steps is not None, critic
        # The actor's adapters (actor.lora), trained instead of its weights.
        a = getattr(model_cfg, "lora", None)
        self.lora_scale = a.alpha / a.rank if self.trainable and a is not None and a.rank else None
        # Trained weights are float32 masters; a LoRA actor's frozen base stays in the compute dtype, the
        # values its forward casts to anyway (half the memory of a float32 copy), and its adapters float32.
        master = torch.float32 if self.trainable and self.lora_scale is None else self.dtype
        model = load_model(self.source_dir, master, critic, attention=ATTENTION)
        if self.lora_scale is not None:
            model = lora.add_adapters(model, a.rank, a.alpha, a.dropout, list(a.target_modules))
            self.recover_only = lora.is_adapter  # the base is the model's path, never changed
        if self.trainable and model_cfg.gradient_checkpointing:
            enable_checkpointing(model, model_cfg.recompute_layers)
        self.net = PackedModel(model, context=self.context).to(self.device)
        if self.device.type == "cuda":
            compile_pointwise(self.net)
        mixed = self.trainable and self.dtype != torch.float32
        _shard(
            self.net,
            MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) if mixed else None,
        )
        self.optimizer = self.scheduler = None
        self.offload = self.trainable and model_cfg.optimizer.offload
        if self.trainable:
            self.optimizer = make_optimizer(self.net, model_cfg.optimizer)
            self.scheduler = make_schedule(self.optimizer, total_train_steps, model_cfg.optimizer)
            if self.offload:
                offload.make_home(self.optimizer, pinned=self.device.type == "cuda")
        else:
            self.net.requires_grad_(False)
        self.net.eval()

    # --- forward ----------------------------------------------------------------------------------------

    def _run(self, mb: Mapping[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
        return self.net(mb["packed_input_ids"], mb[CU], temperature)

    def _inference(self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec, key: str, temperature=1.0):
        inputs = {CU: batch[CU], "packed_input_ids": batch["packed_input_ids"]}
        parts = []
        self.net.eval()
        with torch.no_grad():
            for group in _same_count(micro_batch_groups(seq_lengths(batch), mb_spec)):
                mb = to_torch(EMPTY_MB if group is None else select(inputs, group), self.device)
                values = self._run(mb, temperature)[key]
                if group is not None:
                    parts.append((group, values))
        return in_packed_order(batch[CU], parts)

    def logprobs(self, batch: Mapping[str, np.ndarray], temperature: float, mb_spec: MicroBatchSpec):
        """Token-aligned float32 logprobs (T) of ``packed_input_ids``; 0 at each sequence's first token."""
        if self.critic:
            raise TypeError("a critic engine has values, not logprobs")
        return self._inference(batch, mb_spec, "logprobs", temperature)

    def adapters_off(self):
        """A context in which the engine computes its base model (LoRA; with no adapters, itself)."""
        return lora.adapters_off(self.net)

    def values(self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec) -> torch.Tensor:
        if not self.critic:
            raise TypeError("values need a critic engine (critic=True)")
        return self._inference(batch, mb_spec, "values")

    # --- training ---------------------------------------------------------------------------------------

    def train_minibatch(
        self,
        micro_batches: Sequence[Mapping[str, np.ndarray]],
        loss_fn: LossFn,
        temperature: float = 1.0,
        skip: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's ``micro_batches`` (see ``TrainEngine``)."""
        optimizer = self._require_optimizer()
        optimizer.zero_grad(set_to_none=True)
        self.net.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once: no sync per micro-batch
        with timeline.span("forward_backward", micro_batches=len(micro_batches)):
            for mb_arrays in _same_count(list(micro_batches)):
                mb = to_torch(EMPTY_MB if mb_arrays is None else mb_arrays, self.device)
                outputs = self._run(mb, temperature)
                loss = next(iter(outputs.values())).sum() * 0.0 if mb_arrays is None else loss_fn(outputs, mb)
                loss.backward()
                total += loss.detach().double()
        self.net.eval()
        with timeline.span("optimizer"):
            return {"loss": total.item(), **self._step(skip is not None and skip())}

    def _step(self, skip: bool) -> dict[str, float]:
        params = [p for p in self.net.parameters() if p.requires_grad]
        offloaded = (
            partial(offload.offloaded_step, self.optimizer, params, self.device) if self.offload else None
        )
        return clipped_step(
            self.optimizer, self.scheduler, params, self.cfg.optimizer.gradient_clipping, offloaded, skip
        )

    def release_memory(self) -> None:  # nothing of its own: each step frees its gradients
        pass

    @property
    def module(self) -> torch.nn.Module:
        return self.net

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this engine is inference-only (made with total_train_steps=None)")
        return self.optimizer

    # --- weights out ------------------------------------------------------------------------------------

    def hf_params(self) -> dict[str, torch.Tensor]:
        """The model's parameters under their HF names, each once, as held (shards): their global shapes and
        dtypes plan publication. With adapters, the base weights (what ``hf_weights`` merges them into)."""
        named = self.net.model.named_parameters()
        if self.lora_scale is None:
            return dict(named)
        return {lora.hf_name(name): p for name, p in named if not lora.is_adapter(name)}

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``hf_params`` as full tensors in the compute dtype, gathered one at a time: a collective (every rank
        drains it), and no rank ever holds a second full copy of the model. With adapters, each merged into
        its weight in float32 first (``weights.merged``)."""
        named = self.net.model.named_parameters()
        if self.lora_scale is not None:
            adapter = self._adapter()  # small: gathered whole before the weights
            named = ((lora.hf_name(name), p) for name, p in named if not lora.is_adapter(name))
        full = ((name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in named)
        if self.lora_scale is not None:
            full = merged(full, adapter)
        for name, tensor in full:
            yield name, tensor.detach().to(self.dtype)

    def save_hf(self, path: str | Path) -> Path | None:
        """The model as an HF directory (a collective; rank 0 writes shard files as tensors are gathered)."""
        return write_hf_dir(path, self.net.model, self.hf_weights(), self.source_dir, self.dtype)

    def save_adapter(self, path: str | Path) -> Path | None:
        """The adapters alone as a PEFT folder in the compute dtype (a collective; rank 0 writes it and
        returns its path)."""
        adapter = self._adapter(self.dtype)
        return write_adapter(path, adapter) if dist.get_rank() == 0 else None

    def _adapter(self, dtype: torch.dtype | None = None) -> Adapter:
        """The adapters as full tensors (float32 masters, or ``dtype``); a collective: every rank gathers."""
        a = self.cfg.lora
        full = (
            (name, (p.full_tensor() if isinstance(p, DTensor) else p).detach())
            for name, p in self.net.model.named_parameters()
            if lora.is_adapter(name)
        )
        named = ((name, t if dtype is None else t.to(dtype)) for name, t in full)
        return lora.adapter_of(named, a.rank, a.alpha, str(self.source_dir))

    # --- recover state ----------------------------------------------------------------------------------

    def load_state_dict(self, state: dict) -> None:
        if not self.offload:
            return super().load_state_dict(state)
        load_tensors(self.net, None, state, self.recover_only)  # the weights; the optimizer's stay on the CPU
        offload.load_home(self.net, self.optimizer, state["optimizer"])


def _same_count(items: list) -> list:
    """``items`` padded with None up to the longest list of any rank (each None: an empty micro-batch)."""
    n = int(dist.all_reduce(torch.tensor(len(items)), "max").item())
    return list(items) + [None] * (n - len(items))
