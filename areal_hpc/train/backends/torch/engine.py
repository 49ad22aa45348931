"""TorchEngine: one model on one trainer rank. Forward passes over micro-batches, and optimizer steps whose
gradients are summed over the data-parallel ranks (plain data parallelism, no wrapper: every rank holds the
whole model and ends each step with the same weights).

Precision: an engine that trains keeps float32 weights (the master copy AdamW updates) and runs the forward
under autocast in the configured dtype; an inference-only engine (ref) loads its weights in that dtype.
With float32 configured (the tests) both are plain float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from areal_hpc.config import MicroBatchSpec, ModelConfig
from areal_hpc.control import timeline
from areal_hpc.data import CU, select
from areal_hpc.train import dist
from areal_hpc.train.backends.hf_dir import write_hf_dir
from areal_hpc.train.backends.recover_state import RecoverState
from areal_hpc.train.microbatch import in_packed_order, micro_batch_groups, pad, seq_lengths, to_torch, unpad
from areal_hpc.train.models import DTYPES, enable_checkpointing, load_model
from areal_hpc.train.numerics import (
    LossFn,
    clipped_step,
    make_optimizer,
    make_schedule,
    token_entropy,
    token_logprobs,
)

GRAD_BUCKET_NUMEL = 32 * 1024 * 1024  # gradients all-reduced per bucket of this many elements


def _buckets(params: Sequence[torch.nn.Parameter], max_numel: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, about ``max_numel`` elements per bucket."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not buckets or size + p.numel() > max_numel or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    return buckets


class TorchEngine(RecoverState):
    """A model (causal LM, or with ``critic`` a value model) on this rank, with its optimizer if it trains.

    ``total_train_steps`` is the number of optimizer steps of the whole run (training steps times
    ``ppo_n_minibatches``), the length of the LR schedule; ``None`` makes an inference-only engine.
    Every rank must pass the same ``seed`` (it seeds the value head and anything random in the model).
    """

    dp_group = None  # every rank holds data of its own

    def __init__(
        self,
        model_cfg: ModelConfig,
        total_train_steps: int | None = None,
        seed: int = 1,
        *,
        critic: bool = False,
        device: torch.device | str | None = None,
    ):
        if not model_cfg.path:
            raise ValueError("the model config has no path to load the model from")
        torch.manual_seed(seed)
        self.cfg = model_cfg
        self.source_dir = Path(model_cfg.path)
        self.device = torch.device(device) if device is not None else dist.default_device()
        self.dtype = DTYPES[model_cfg.dtype]
        self.trainable = total_train_steps is not None
        self.mixed_precision = self.trainable and self.dtype != torch.float32
        weights_dtype = torch.float32 if self.trainable else self.dtype
        self.model = load_model(self.source_dir, weights_dtype, critic=critic).to(self.device)
        self.critic = critic
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.trainable:
            if model_cfg.gradient_checkpointing:
                enable_checkpointing(self.model, model_cfg.recompute_layers)
            self.optimizer = make_optimizer(self.model, model_cfg.optimizer)
            self.scheduler = make_schedule(self.optimizer, total_train_steps, model_cfg.optimizer)
        else:
            self.model.requires_grad_(False)
        self.model.eval()

    # --- forward ----------------------------------------------------------------------------------------

    def forward(self, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Model outputs of a packed micro-batch: logits ``[T, V]`` (LM) or float32 values ``[T]`` (critic)."""
        ids, mask = pad(mb["packed_input_ids"], mb[CU])
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.mixed_precision):
            out = self.model(input_ids=ids, attention_mask=mask.long(), use_cache=False)
        # Logits stay in the compute dtype here: at real vocabulary sizes every float32 copy costs gigabytes.
        return unpad(out, mask).float() if self.critic else unpad(out.logits, mask)

    def _inference(
        self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec, per_token: LossFn
    ) -> torch.Tensor:
        """``per_token(outputs, mb)`` of every micro-batch, put back in the batch's packed order (float32, CPU)."""
        inputs = {CU: batch[CU], "packed_input_ids": batch["packed_input_ids"]}
        parts = []
        self.model.eval()
        with torch.no_grad():
            for group in micro_batch_groups(seq_lengths(batch), mb_spec):
                mb = to_torch(select(inputs, group), self.device)
                parts.append((group, per_token(self.forward(mb), mb)))
        return in_packed_order(batch[CU], parts)

    def logprobs(
        self, batch: Mapping[str, np.ndarray], temperature: float, mb_spec: MicroBatchSpec
    ) -> torch.Tensor:
        """Token-aligned float32 logprobs (T) of ``packed_input_ids`` given the previous tokens; 0 at each
        sequence's first token. Logits are divided by ``temperature``."""
        if self.critic:
            raise TypeError("a critic engine has values, not logprobs")
        return self._inference(
            batch,
            mb_spec,
            lambda logits, mb: token_logprobs(logits, mb["packed_input_ids"], mb[CU], temperature),
        )

    def values(self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec) -> torch.Tensor:
        """The critic's value (T, float32) of each prefix ending at each token."""
        if not self.critic:
            raise TypeError("values need a critic engine (critic=True)")
        return self._inference(batch, mb_spec, lambda values, mb: values)

    # --- training ---------------------------------------------------------------------------------------

    def outputs(self, mb: Mapping[str, torch.Tensor], temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """The per-token outputs a loss takes (``numerics.LossFn``), from the full logits."""
        out = self.forward(mb)
        if self.critic:
            return {"values": out}
        ids, cu = mb["packed_input_ids"], mb[CU]
        return {
            "logprobs": token_logprobs(out, ids, cu, temperature),
            "entropy": token_entropy(out, cu, temperature),
        }

    def train_minibatch(
        self,
        micro_batches: Sequence[Mapping[str, np.ndarray]],
        loss_fn: LossFn,
        temperature: float = 1.0,
        skip: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a minibatch: gradients accumulated over ``micro_batches``, summed over ranks.

        ``loss_fn`` must already divide each micro-batch's loss by the minibatch's GLOBAL normaliser (e.g. its
        valid tokens over all ranks), so the summed gradients are those of the global mean. A rank with no
        micro-batches still joins the step. Returns ``loss`` (this rank's summed losses), ``grad_norm``
        (before clipping) and ``lr`` (the rate this step used). ``skip``: see ``TrainEngine``.
        """
        self._require_optimizer().zero_grad(set_to_none=True)
        with timeline.span("forward_backward", micro_batches=len(micro_batches)):
            loss = self.backward(micro_batches, loss_fn, temperature)
        with timeline.span("optimizer"):
            return {"loss": loss, **self.step(skip is not None and skip())}

    def backward(
        self, micro_batches: Sequence[Mapping[str, np.ndarray]], loss_fn: LossFn, temperature: float = 1.0
    ) -> float:
        """Accumulate this rank's gradients of ``loss_fn`` over ``micro_batches``; returns the summed loss."""
        self._require_optimizer()
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once: no sync per micro-batch
        for mb_arrays in micro_batches:
            mb = to_torch(mb_arrays, self.device)
            loss = loss_fn(self.outputs(mb, temperature), mb)
            loss.backward()
            total += loss.detach().double()
        self.model.eval()
        return total.item()

    def step(self, skip: bool = False) -> dict[str, float]:
        """Sum gradients over ranks, clip, step the optimizer and the LR schedule; ``grad_norm`` and ``lr``.

        ``skip``, or a non-finite gradient norm, leaves the weights as they are (on every rank alike).
        """
        optimizer = self._require_optimizer()
        self._all_reduce_grads()
        params = [p for p in self.model.parameters() if p.requires_grad]
        return clipped_step(
            optimizer, self.scheduler, params, self.cfg.optimizer.gradient_clipping, skip=skip
        )

    def _all_reduce_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused on this rank (or no micro-batch here): contributes zero
                p.grad = torch.zeros_like(p)
        if dist.get_world_size() == 1:
            return
        for bucket in _buckets(params, GRAD_BUCKET_NUMEL):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce_(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def release_memory(self) -> None:  # nothing of its own: each step frees its gradients
        pass

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this engine is inference-only (made with total_train_steps=None)")
        return self.optimizer

    # --- saving -----------------------------------------------------------------------------------------

    def save_hf(self, path: str | Path) -> Path | None:
        """Write the model as an HF directory at ``path`` (weights in the configured dtype, safetensors, the
        source's tokenizer files, a manifest last), atomically. Rank 0 writes; other ranks return None."""
        return write_hf_dir(path, self.model, self.hf_weights(), self.source_dir, self.dtype)

    def hf_params(self) -> dict[str, torch.Tensor]:
        """The model's weights under their HF names, in the HF state dict's order (tied weights under every
        name): what weight publication plans and sends."""
        return dict(self.model.state_dict())

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``hf_params`` one tensor at a time (no collective: every rank holds them whole)."""
        yield from self.hf_params().items()
