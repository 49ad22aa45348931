"""A model's tensor, pipeline and data-parallel groups on the trainer's process group.

Megatron orders ranks tensor fastest, then data, then pipeline: the order of ``alloc.ParallelSpec.coords``, so
the trainer rank that allocation places at (dp, tp, pp) is Megatron's rank of the same coordinates. The model
that trains uses Megatron's global groups; a copy of it on another per-MFC layout has groups of its own.

Without CUDA (the test suite's CPU ranks on gloo), megatron-core's hard-coded CUDA device means the CPU while
the engine runs (``on_device``): tensors it makes on "cuda" are made on the CPU, ``Tensor.cuda()`` leaves a
tensor where it is, ``torch.cuda.current_device()`` answers "cpu", ``synchronize()`` returns and
``get_rng_state()`` gives the CPU generator's state (for recomputation). That is the whole substitute of the CPU
path: the model, Megatron's DDP, distributed optimizer and schedules are megatron-core's own. With CUDA
nothing is changed.
"""

from __future__ import annotations

import contextlib
from functools import cache

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.overrides import TorchFunctionMode

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


def on_device() -> contextlib.AbstractContextManager:
    """Where megatron-core runs: as it is with CUDA; without, under ``_CudaMeansCpu``."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"  # not torch functions: no mode sees them
    torch.cuda.synchronize = lambda device=None: None
    # Recomputation saves the generator's state for dropout (0 here); setting it back is queued, never run.
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    return _CudaMeansCpu()


def model_groups(tp: int, pp: int, trainable: bool) -> ProcessGroupCollection:
    """The process groups of a model at tensor size ``tp`` and pipeline size ``pp`` over the whole process group
    (world = dp * tp * pp), on every rank (a collective).

    The first model sets Megatron's global groups (``parallel_state``), which a trained model needs: Megatron's
    DDP and distributed optimizer read them. An inference-only model on another layout (a per-MFC layout: the
    actor's copy for actor_inf) gets groups of its own, which its layers and schedule take as their
    ``pg_collection``."""
    world = torch.distributed.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"{world} trainer ranks do not make data-parallel groups of tp{tp} x pp{pp}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have == (tp, pp):
        return ProcessGroupCollection.use_mpu_process_groups()
    if trainable:
        raise RuntimeError(
            f"a trained model needs Megatron's global groups, which are tp{have[0]} pp{have[1]}, not tp{tp} pp{pp}"
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


def layout_of(groups: ProcessGroupCollection) -> Layout:
    """This rank's place in the layout of ``groups``."""
    return Layout(
        tp=groups.tp.size(), tp_rank=groups.tp.rank(), pp=groups.pp.size(), pp_rank=groups.pp.rank()
    )
