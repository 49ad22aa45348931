"""A model's tensor, pipeline, data and expert-parallel groups on the trainer's process group.

Megatron orders ranks tensor fastest, then data, then pipeline: the order of ``alloc.ParallelSpec.coords``, so
the trainer rank that allocation places at (dp, tp, pp) is Megatron's rank of the same coordinates. The model
that trains uses Megatron's global groups; a copy of it on another per-MFC layout has groups of its own.
Expert-parallel groups are consecutive ranks of a stage's data x tensor ranks (Megatron's order with expert
tensor size 1): ranks of one group hold different experts, the ranks at the same place in every group the same.

Without CUDA (the test suite's CPU ranks on gloo), megatron-core's hard-coded CUDA device means the CPU while
the engine runs (``on_device``): tensors it makes on "cuda" are made on the CPU, ``Tensor.cuda()`` leaves a
tensor where it is, ``torch.cuda.current_device()`` answers "cpu", ``synchronize()`` returns and
``get_rng_state()`` gives the CPU generator's state (for recomputation), and CUDA streams are one stream that has
always finished (the MoE token dispatcher's device-to-host copies, whose split sizes it wants as numpy arrays:
``_host_splits``). That is the whole substitute of the CPU
path: the model, Megatron's DDP, distributed optimizer and schedules are megatron-core's own. With CUDA
nothing is changed.
"""

from __future__ import annotations

import contextlib
from functools import cache

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import token_dispatcher
from torch.overrides import TorchFunctionMode

from areal_hpc.train import dist
from areal_hpc.train.backends.megatron.convert import Layout


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaMeansCpu(TorchFunctionMode):
    """Every torch call made under it with a CUDA device makes it on the CPU; ``Tensor.cuda()`` is a no-op and
    ``Tensor.type()`` names CUDA types (megatron-core picks its code paths by those names)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        kwargs = {k: "cpu" if k == "device" and _is_cuda(v) else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class _HostStream:
    """The CPU's only stream: work is done when it is queued."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self  # an event that has happened

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors already there: numpy when asked (the
    all-to-all's split sizes), which the original returns only for tensors it moved from a GPU."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def on_device() -> contextlib.AbstractContextManager:
    """Where megatron-core runs: as it is with CUDA; without, under ``_CudaMeansCpu``."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"  # not torch functions: no mode sees them
    torch.cuda.synchronize = lambda device=None: None
    # Recomputation saves the generator's state for dropout (0 here); setting it back is queued, never run.
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.Stream = _HostStream  # a class still: annotations such as `torch.cuda.Stream | None` hold
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_splits
    return _CudaMeansCpu()


def model_groups(tp: int, pp: int, trainable: bool, ep: int = 1, seed: int = 1) -> ProcessGroupCollection:
    """The process groups of a model at tensor size ``tp``, pipeline size ``pp`` and expert size ``ep`` over the
    whole process group (world = dp * tp * pp; ``ep`` divides dp * tp), on every rank (a collective).

    The first model sets Megatron's global groups (``parallel_state``), which a trained model needs: Megatron's
    DDP and distributed optimizer read them. An inference-only model on another layout (a per-MFC layout: the
    actor's copy for actor_inf) gets groups of its own, which its layers and schedule take as their
    ``pg_collection``."""
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"{world} trainer ranks do not make data-parallel groups of tp{tp} x pp{pp}")
    if (world // pp) % ep:
        raise ValueError(f"expert size {ep} does not divide the {world // pp} data x tensor ranks of a stage")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
        # Megatron's RNG streams per model-parallel rank, which it forks for dropout (0 here) under sequence
        # parallelism; seeded as the engine seeds torch.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    )
    if have == (tp, pp, ep):
        return ProcessGroupCollection.use_mpu_process_groups()
    if trainable:
        raise RuntimeError(
            f"a trained model needs Megatron's global groups, which are tp{have[0]} pp{have[1]} ep{have[2]}, "
            f"not tp{tp} pp{pp} ep{ep}"
        )
    if ep > 1:
        raise NotImplementedError(
            f"an inference-only copy at expert size {ep} on a layout of its own (tp{tp} pp{pp}): give it the "
            "trained model's layout"
        )
    return _own_groups(tp, pp)


@cache  # one set per layout: new groups are made by every rank, in the same order
def _own_groups(tp: int, pp: int) -> ProcessGroupCollection:
    world = torch.distributed.get_world_size()
    grid = np.arange(world).reshape(
        pp, world // (tp * pp), tp
    )  # rank = tp_rank + tp * (dp_rank + dp * pp_rank)

    def along(axis: int) -> list[list[int]]:
        return np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis]).tolist()

    def group(ranks: list[list[int]]) -> torch.distributed.ProcessGroup:
        return torch.distributed.new_subgroups_by_enumeration(ranks)[0]  # this rank's

    groups = ProcessGroupCollection(
        tp=group(along(2)), dp=group(along(1)), pp=group(along(0)), cp=group([[r] for r in range(world)])
    )
    groups.dp_cp, groups.pos_embd = groups.dp, None  # no context parallelism; rotary positions
    groups.embd = group([sorted({p[0], p[-1]}) for p in along(0)])  # a tied embedding's: first and last stage
    return groups


def _release_groups() -> None:
    """Drop the groups held in Megatron's globals and by ``_own_groups``, so that dist can free them (and end
    their gloo threads) when the trainer's group is destroyed; the next model sets them anew."""
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):  # 0.16's destroy leaves the partial-DP groups set
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
    _own_groups.cache_clear()


dist.on_release(_release_groups)


def layout_of(groups: ProcessGroupCollection) -> Layout:
    """This rank's place in the layout of ``groups``."""
    ep = getattr(groups, "ep", None)
    return Layout(
        tp=groups.tp.size(),
        tp_rank=groups.tp.rank(),
        pp=groups.pp.size(),
        pp_rank=groups.pp.rank(),
        ep=ep.size() if ep is not None else 1,
        ep_rank=ep.rank() if ep is not None else 0,
    )
