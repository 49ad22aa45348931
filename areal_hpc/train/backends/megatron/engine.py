"""MegatronEngine: one model as a megatron-core GPTModel, tensor, pipeline, data and expert parallel, on packed
micro-batches.

- Layout: process groups over the trainer's process group (``parallel.model_groups``: Megatron's global ones, or
  an inference-only copy's own); each rank holds its TP shard of its PP stage's layers, loaded from the HF
  checkpoint shard by shard (``convert``), or re-sharded from another engine's weights (``load_weights``:
  parameter reallocation). Ranks of one data-parallel replica (its TP x PP ranks) run the same micro-batches.
- Precision: parameters in the compute ``dtype``; float32 gradients (Megatron's DDP buffers) and float32
  master weights and Adam state in Megatron's distributed optimizer, sharded over the data-parallel ranks.
- Schedule: every forward and backward runs through Megatron's schedule (1F1B over the stages with pipeline
  size > 1); gradients are SUMMED over data-parallel ranks (the losses come normalised), clipped by the
  optimizer over the whole model.
- The LM head is ``train.head``'s, by chunks of tokens over this TP rank's slice of the vocabulary.
- Mixture of experts (``moe``): each expert-parallel rank holds ``experts / ep`` experts of every sparse layer;
  the ranks of an expert-parallel group exchange tokens in every sparse layer, so they run the same number of
  micro-batches (empty ones where a rank has fewer). Sequence parallel with TP > 1: a micro-batch is padded to a
  multiple of TP tokens, the head gathers the hidden states of the whole sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from areal_hpc.algo import align_next_token
from areal_hpc.config import MicroBatchSpec, ModelConfig
from areal_hpc.control import timeline
from areal_hpc.data import CU, select
from areal_hpc.data import ROUTED_EXPERTS as ROUTED
from areal_hpc.train import dist
from areal_hpc.train.backends.hf_dir import write_hf_dir
from areal_hpc.train.backends.megatron import convert, moe, replay
from areal_hpc.train.backends.megatron.model import (
    PackedRope,
    build_model,
    head_dim,
    output_weight,
    rope_tables,
    rope_theta,
    transformer_config,
)
from areal_hpc.train.backends.megatron.parallel import layout_of, model_groups, on_device
from areal_hpc.train.head import HEAD_CHUNK_TOKENS, vocab_parallel_logprobs
from areal_hpc.train.microbatch import EMPTY_MB, in_packed_order, micro_batch_groups, seq_lengths, to_torch
from areal_hpc.train.models import DTYPES, compile_pointwise
from areal_hpc.train.numerics import LossFn, lr_factor
from areal_hpc.train.packed import packed_kwargs
from areal_hpc.train.sharded import RankLocal


def hf_reader(model_dir: Path):
    """``read(name)``: one full tensor of the HF checkpoint in ``model_dir`` (one file or an index of them)."""
    index = model_dir / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    @cache
    def handle(file: str):
        return safe_open(model_dir / file, "pt")

    def read(name: str) -> torch.Tensor:
        return handle(files[name] if files else "model.safetensors").get_tensor(name)

    return read


def hf_shapes(model_dir: Path) -> dict[str, list[int]]:
    """The shape of every tensor of the HF checkpoint in ``model_dir``, from the safetensors headers."""
    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})  # noqa: SIM118 (not a dict)
    return shapes


def packed_params(cu_seqlens: torch.Tensor, hf: dict, dtype: torch.dtype) -> tuple[torch.Tensor, PackedRope]:
    """The positions (restarting at 0 per sequence) and Megatron's description of a packed micro-batch, with
    its rotary tables."""
    kw = packed_kwargs(cu_seqlens)
    positions, cu32, longest = kw["position_ids"][0], kw["cu_seq_lens_q"], kw["max_length_q"]
    cos, sin = rope_tables(positions, head_dim(hf), rope_theta(hf), dtype)
    return positions, PackedRope(
        qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=longest, max_seqlen_kv=longest,
        cos=cos, sin=sin,
    )  # fmt: skip


def _finalize(model, num_tokens=None, **kwargs):
    """Megatron's gradient reduction without its division by the token count (our losses are normalised)."""
    finalize_model_grads(model, None, **kwargs)


class MegatronEngine:
    """A causal LM on this rank's part of a ``tensor`` x ``pipeline`` layout (data parallel over the rest)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        total_train_steps: int | None = None,
        seed: int = 1,
        *,
        critic: bool = False,
        tensor: int = 1,
        pipeline: int = 1,
        expert: int = 1,
    ):
        if critic:
            raise NotImplementedError("the megatron backend has no value model yet: give critic.backend fsdp")
        if not model_cfg.path:
            raise ValueError("the model config has no path to load the model from")
        dist.init_alone()
        torch.manual_seed(seed)
        self.cfg, self.source_dir = model_cfg, Path(model_cfg.path)
        self.hf = json.loads((self.source_dir / "config.json").read_text())
        self.device, self.dtype = dist.default_device(), DTYPES[model_cfg.dtype]
        self.trainable = total_train_steps is not None
        self.total_steps, self.steps_done = max(1, total_train_steps or 1), 0
        with on_device():
            self.groups = model_groups(tensor, pipeline, self.trainable, expert, seed)
            self.layout = layout_of(self.groups)
            recompute = self.trainable and getattr(model_cfg, "gradient_checkpointing", False)
            replaying = getattr(model_cfg, "router_replay", "off") == "rollout"
            self.config = transformer_config(
                self.hf, self.dtype, tensor, pipeline, recompute, expert, replay=replaying,
                recompute_layers=getattr(model_cfg, "recompute_layers", None),
            )  # fmt: skip
            self.moe = moe.MoeStats(self.hf, self.config) if self.config.num_moe_experts else None
            self.model = build_model(self.hf, self.config, self.layout, self.groups).to(self.device)
            self.load_hf(self.source_dir)
            if self.device.type == "cuda":
                compile_pointwise(self.model)
            if self.moe is not None:
                self.moe.watch(self.model)
            self.replayer = None  # routes as the generation servers did
            if self.config.moe_enable_routing_replay:
                sp = self.config.sequence_parallel
                self.replayer = self.moe.replayer = replay.Replayer(
                    replay.routers(self.model), self.layout, sp
                )
            self.tp_group, self.dp_group = self.groups.tp, self.groups.dp
            self._views = None  # hf_weights' views of the parameters (TP, PP and EP size 1)
            self.optimizer = self.ddp = None
            self._grads_released = False  # release_memory gave the gradient buffers back
            if self.trainable:
                self._make_optimizer()
            else:
                self.model.requires_grad_(False)
        self.model.eval()

    def load_hf(self, model_dir: str | Path) -> None:
        """This rank's shards from the HF checkpoint in ``model_dir``: the model's own, or another engine's
        ``save_hf`` (parameter reallocation through the disk)."""
        self._copy_in(convert.load_shards(self.hf, self.layout, hf_reader(Path(model_dir))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Parameter reallocation: this rank's shards taken from full HF tensors, as another engine's
        ``hf_weights()`` gives them on every rank (drained to the end: a collective of that engine)."""
        self._copy_in(convert.stream_shards(self.hf, self.layout, weights))

    def _copy_in(self, shards: Iterator[tuple[str, convert.Param, torch.Tensor]]) -> None:
        """Copy ``shards`` into the parameters, every one of them. Each is also marked with its TP split, which
        megatron-core sets only when it initialises weights itself (the optimizer's gradient norm reads it)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param, shard in shards:
                tensor = params.pop(name)
                tensor.copy_(shard)
                if param.tp_dim is not None:  # the attributes of set_tensor_model_parallel_attributes
                    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = (
                        True,
                        param.tp_dim,
                        1,
                    )
        if params:
            raise RuntimeError(f"no HF weights for Megatron parameters {sorted(params)}")

    def _make_optimizer(self) -> None:
        opt = self.cfg.optimizer
        self.ddp = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            self.model,
        )
        self.config.finalize_model_grads_func = _finalize
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.beta1,
                adam_beta2=opt.beta2,
                adam_eps=opt.eps,
                clip_grad=opt.gradient_clipping,
                bf16=self.dtype == torch.bfloat16,
                fp16=self.dtype == torch.float16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            ),
            [self.ddp],
        )
        if self.moe is not None:  # the experts' optimizer, built after the dense one
            # megatron-core gives it the attention's TP group, and its gradient norm then skips the experts of
            # TP ranks > 0 as copies of rank 0's; with expert tensor size 1 every rank's experts are its own.
            dense, experts = self.optimizer.chained_optimizers
            experts.tp_group = self.groups.expt_tp
        self._set_lr()

    def _set_lr(self) -> None:
        lr = self.cfg.optimizer.lr * lr_factor(self.steps_done, self.total_steps, self.cfg.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # --- the schedule -----------------------------------------------------------------------------------

    def _head(self, hidden: torch.Tensor, mb: Mapping[str, torch.Tensor], temperature: float):
        ids = mb["packed_input_ids"]
        if self.config.sequence_parallel:  # the whole sequence (backward: this rank's part of the gradient,
            # which the vocabulary-parallel head has already summed over the TP ranks)
            hidden = gather_from_sequence_parallel_region(hidden, False, self.tp_group)[: len(ids)]
        logp, entropy = vocab_parallel_logprobs(
            hidden[:, 0],
            output_weight(self.model),
            torch.roll(ids, -1),
            self.tp_group,
            temperature,
            HEAD_CHUNK_TOKENS,
        )
        cu = mb[CU]
        return {"logprobs": align_next_token(logp, cu), "entropy": align_next_token(entropy, cu)}

    def _schedule(self, mbs: list[dict[str, torch.Tensor]], temperature: float, loss_fn: LossFn | None):
        """Megatron's schedule over ``mbs``; on the last stage, each micro-batch's outputs (inference) or losses.

        With ``loss_fn`` None it runs forward only and returns the outputs; else forward and backward."""
        model = self.ddp if self.ddp is not None else self.model

        def forward_step(data_iterator, net):
            mb = next(data_iterator)
            ids, cu = mb["packed_input_ids"], mb[CU]
            if self.config.sequence_parallel:
                ids, cu = moe.pad_to_multiple(ids, cu, self.layout.tp)
            mask = moe.padding_mask(len(mb["packed_input_ids"]), len(ids), self.layout)
            if self.replayer is not None:
                self.replayer.add(mb.get(ROUTED), len(ids))
            positions, packed = packed_params(cu, self.hf, self.dtype)
            hidden = net(
                ids[None], positions[None], None, packed_seq_params=packed,
                padding_mask=None if mask is None else mask.to(ids.device),
            )  # fmt: skip

            def loss_func(last_hidden):
                outputs = self._head(last_hidden, mb, temperature)
                if loss_fn is None:
                    return last_hidden.new_zeros(()), torch.tensor(1), {"outputs": outputs}
                loss = loss_fn(outputs, mb) if mb.get("empty") is None else outputs["logprobs"].sum() * 0.0
                return loss, torch.tensor(1), {"loss": loss.detach()}

            return hidden, loss_func

        pipeline = (
            {"p2p_communicator": P2PCommunicator(self.groups.pp, self.config)} if self.layout.pp > 1 else {}
        )
        if self.replayer is not None:
            self.replayer.start()
        if self.layout.ep > 1:  # every rank of an expert-parallel group runs as many micro-batches
            mbs = mbs + [self._empty_mb()] * (moe.most_micro_batches(len(mbs), self.groups.dp) - len(mbs))
        with on_device():
            return get_forward_backward_func(pp_size=self.layout.pp)(
                forward_step_func=forward_step,
                data_iterator=iter(mbs),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=max(int(mb[CU][-1]) for mb in mbs),
                micro_batch_size=1,
                forward_only=loss_fn is None,
                pg_collection=self.groups,
                **pipeline,
            )

    def _empty_mb(self) -> dict[str, torch.Tensor]:
        """A micro-batch of one token that trains nothing (a rank without samples still joins the collectives)."""
        return {**to_torch(EMPTY_MB, self.device), "empty": torch.ones(())}

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage (in place: a broadcast over the pipeline group)."""
        if self.layout.pp > 1:
            torch.distributed.broadcast(
                tensor,
                src=torch.distributed.get_global_rank(self.groups.pp, self.layout.pp - 1),
                group=self.groups.pp,
            )
        return tensor

    # --- forward ----------------------------------------------------------------------------------------

    def logprobs(self, batch: Mapping[str, np.ndarray], temperature: float, mb_spec: MicroBatchSpec):
        """Token-aligned float32 logprobs (T) of ``packed_input_ids``; 0 at each sequence's first token."""
        inputs = {CU: batch[CU], "packed_input_ids": batch["packed_input_ids"]}
        if self.replayer is not None and ROUTED in batch:
            inputs[ROUTED] = batch[ROUTED]
        groups = micro_batch_groups(seq_lengths(batch), mb_spec)
        mbs = [to_torch(select(inputs, g), self.device) for g in groups]
        self.model.eval()
        with torch.no_grad():
            results = self._schedule(mbs, temperature, None)
        lengths = [int(mb[CU][-1]) for mb in mbs]
        if self.layout.last:  # the outputs live on the last stage (those of padding micro-batches dropped)
            flat = torch.cat([r["outputs"]["logprobs"].float() for r in results[: len(mbs)]])
        else:
            flat = torch.empty(sum(lengths), device=self.device)
        values = self._from_last_stage(flat).split(lengths)
        return in_packed_order(batch[CU], list(zip(groups, values, strict=True)))

    def values(self, batch: Mapping[str, np.ndarray], mb_spec: MicroBatchSpec) -> torch.Tensor:
        raise TypeError("values need a critic engine; the megatron backend has none yet")

    # --- training ---------------------------------------------------------------------------------------

    def train_minibatch(
        self,
        micro_batches: Sequence[Mapping[str, np.ndarray]],
        loss_fn: LossFn,
        temperature: float = 1.0,
        skip: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """One optimizer step over this replica's ``micro_batches`` (see ``TrainEngine``)."""
        if self.optimizer is None:
            raise RuntimeError("this engine is inference-only (made with total_train_steps=None)")
        mbs = [to_torch(mb, self.device) for mb in micro_batches]
        if not mbs:  # a replica without samples still joins the gradient reduction and the update
            mbs = [self._empty_mb()]
        with on_device():
            if self._grads_released:  # back, zeroed, under the same views (param.main_grad)
                self.ddp.restore_grad_buffers(synchronize=False)
                self._grads_released = False
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.start_step(sum(int(mb[CU][-1]) for mb in mbs if "empty" not in mb), self.groups.dp)
        self.model.train()
        with timeline.span("forward_backward", micro_batches=len(mbs)):
            results = self._schedule(mbs, temperature, loss_fn)
        self.model.eval()
        total = torch.tensor(sum(float(r["loss"]) for r in results), dtype=torch.float64, device=self.device)
        self._from_last_stage(total)  # the losses live on the last stage
        lr = self.optimizer.param_groups[0]["lr"]
        updated, grad_norm = False, math.nan  # skipped: megatron computes the norm in its step only
        if skip is None or not skip():
            with on_device(), timeline.span("optimizer"):
                updated, grad_norm, _ = self.optimizer.step()
        self.steps_done += 1
        self._set_lr()
        stats = self.moe.end_step(self.groups, len(results)) if self.moe is not None else {}
        return {"loss": float(total), "grad_norm": grad_norm if updated else math.nan, "lr": lr, **stats}

    def release_memory(self) -> None:
        """The gradient buffers (4 bytes a parameter of this rank, or 2) freed until the next step."""
        if self.ddp is not None and not self._grads_released:
            self.ddp.offload_grad_buffers(synchronize=self.device.type == "cuda", empty_cache=False)
            self._grads_released = True

    # --- weights out ------------------------------------------------------------------------------------

    def _exports(self) -> Iterator[tuple[int, str, convert.Param]]:
        """``(stage, param)`` of every parameter any stage exports, stage by stage: the order of both below."""
        for stage in range(self.layout.pp):
            layout = dataclasses.replace(self.layout, pp_rank=stage)  # experts: every rank's
            for name, param in convert.exported(self.hf, layout).items():
                yield stage, name, param

    def hf_params(self) -> dict[str, torch.Tensor]:
        """Every stage's weights under their HF names, as meta tensors of their full shapes (the bucket plan)."""
        shapes = hf_shapes(self.source_dir)
        return {
            hf_name: torch.empty(shapes[hf_name], dtype=self.dtype, device="meta")
            for _, _, param in self._exports()
            for hf_name in param.hf_names
        }

    def _stage_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's weights under their HF names: each parameter gathered over the TP ranks, stacked experts
        over the expert-parallel ranks (with size 1, views of the parameter)."""
        params = dict(self.model.named_parameters())
        for name, param in convert.exported(self.hf, self.layout).items():
            group, size = (
                (self.groups.ep, self.layout.ep) if param.experts else (self.tp_group, self.layout.tp)
            )
            shards = [params[name].detach()]
            if size > 1:
                shards = [torch.empty_like(shards[0]) for _ in range(size)]
                torch.distributed.all_gather(shards, params[name].detach(), group=group)
            yield from zip(param.hf_names, convert.unshard(param, shards, self.hf), strict=True)

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights under their HF names, one Megatron parameter at a time, on every rank (a collective):
        the stage that holds it gathers it over its TP ranks, then sends it to the other stages (a broadcast
        over the pipeline group). No rank holds more than one full parameter besides its own shards. With TP and
        PP size 1 they are views of the parameters (``_one_rank_weights``): publication then costs the buckets'
        copies."""
        if self.layout.tp == self.layout.pp == self.layout.ep == 1:
            yield from self._one_rank_weights()
        elif self.layout.pp == 1:
            yield from self._stage_weights()
        else:
            yield from self._across_stages()

    def _one_rank_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """TP and PP size 1: views of the parameters, made once; q, k and v, which no view can hold (a KV
        group's rows sit between them), are split from the fused parameter each time."""
        if self._views is None:
            params = dict(self.model.named_parameters())
            self._views = []
            for name, param in convert.exported(self.hf, self.layout).items():
                tensor = params[name].detach()
                views = None if param.kind == "qkv" else convert.unshard(param, [tensor], self.hf)
                self._views.append((param, tensor, views))
        for param, tensor, views in self._views:
            yield from zip(param.hf_names, views or convert.unshard(param, [tensor], self.hf), strict=True)

    def _across_stages(self) -> Iterator[tuple[str, torch.Tensor]]:
        pp_group, shapes = self.groups.pp, hf_shapes(self.source_dir)
        mine = self._stage_weights()  # in the order _exports lists this stage's
        for stage, _, param in self._exports():
            for hf_name in param.hf_names:
                if stage == self.layout.pp_rank:
                    full = next(mine)[1].contiguous()
                else:
                    full = torch.empty(shapes[hf_name], dtype=self.dtype, device=self.device)
                src = torch.distributed.get_global_rank(pp_group, stage)
                torch.distributed.broadcast(full, src=src, group=pp_group)
                yield hf_name, full

    def save_hf(self, path: str | Path) -> Path | None:
        """The model as an HF directory (a collective; rank 0 writes shard files as tensors are gathered)."""
        with torch.device("meta"):  # the HF model only for its config and generation config
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.source_dir))
        return write_hf_dir(path, skeleton, self.hf_weights(), self.source_dir, self.dtype)

    # --- recover state ----------------------------------------------------------------------------------

    @property
    def _tag(self) -> str:
        """This rank's place in the layout, in the names of its checkpoint tensors: a checkpoint resumes onto
        the layout that wrote it (another one finds none of its names)."""
        lay = self.layout
        return f"tp{lay.tp_rank}of{lay.tp}-pp{lay.pp_rank}of{lay.pp}"

    def _adam_params(self) -> Iterator[tuple[str, torch.optim.Optimizer, torch.Tensor]]:
        """This rank's float32 shards that Adam updates (inside Megatron's distributed optimizer), named."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        dp, n_dp = self.groups.dp.rank(), self.groups.dp.size()
        for i, inner in enumerate(o.optimizer for o in chained):
            for g, group in enumerate(inner.param_groups):
                for j, param in enumerate(group["params"]):
                    yield f"{self._tag}-dp{dp}of{n_dp}/{i}.{g}.{j}", inner, param

    def state_dict(self) -> dict[str, RankLocal]:
        """This rank's own tensors (``RankLocal``): its weights (written by data-parallel rank 0: the replicas
        are equal and load them from it; split experts by expert-data-parallel rank 0 of each expert-parallel
        rank, under names with that rank), and its shards of the float32 master weights and Adam's state, made
        (zero) if no step has run yet so that a load finds where to go."""
        model, experts = {}, {}
        for name, param in self.model.named_parameters():
            if getattr(param, "allreduce", True):
                model[f"{self._tag}/{name}"] = param.detach()
            else:  # experts split over the expert-parallel ranks: each rank holds others
                experts[f"{self._tag}-ep{self.layout.ep_rank}of{self.layout.ep}/{name}"] = param.detach()
        optimizer = {}
        for name, inner, param in self._adam_params() if self.optimizer is not None else ():
            if not inner.state.get(param):  # as torch's AdamW starts it: its first step is unchanged
                inner.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param),
                    "exp_avg_sq": torch.zeros_like(param),
                }
            if self.dtype != torch.float32:  # else Adam updates shards of the weights themselves
                optimizer[f"{name}.main"] = param.detach()
            optimizer.update({f"{name}.{k}": v for k, v in inner.state[param].items()})
        replica = self.groups.dp.rank() > 0  # loads them; data-parallel rank 0 writes them
        state = {"model": model if replica else RankLocal(model), "optimizer": RankLocal(optimizer)}
        if experts:
            state["experts"] = experts if self.groups.expt_dp.rank() > 0 else RankLocal(experts)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy ``state`` (``state_dict``'s names) into this rank's tensors."""
        with torch.no_grad():
            for part, own in self.state_dict().items():
                for name, tensor in own.items():
                    if state[part][name] is not tensor:
                        tensor.copy_(state[part][name])

    def schedule_state(self) -> dict:
        return {"steps_done": self.steps_done}

    def load_schedule_state(self, state) -> None:
        if state:
            self.steps_done = int(state["steps_done"])
            self._set_lr()
