"""Megatron's parallel state (tensor, pipeline, data groups) on the trainer's process group.

Megatron orders ranks tensor fastest, then data, then pipeline: the order of ``alloc.ParallelSpec.coords``, so
the trainer rank that allocation places at (dp, tp, pp) is Megatron's rank of the same coordinates.

Without CUDA (the test suite's CPU ranks on gloo), megatron-core's hard-coded CUDA device means the CPU while
the engine runs (``on_device``): tensors it makes on "cuda" are made on the CPU, ``Tensor.cuda()`` leaves a
tensor where it is, ``torch.cuda.current_device()`` answers "cpu", ``synchronize()`` returns and
``get_rng_state()`` gives the CPU generator's state (for recomputation). That is the whole substitute of the CPU
path: the model, Megatron's DDP, distributed optimizer and schedules are megatron-core's own. With CUDA
nothing is changed.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
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


def init_parallel(tp: int, pp: int) -> Layout:
    """Megatron's groups over the whole process group (world = dp * tp * pp); this rank's layout.

    Called again with the same sizes it keeps the groups; with other sizes it is an error."""
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise RuntimeError(f"Megatron's groups are tp{have[0]} pp{have[1]} already; asked tp{tp} pp{pp}")
    else:
        world = torch.distributed.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"{world} trainer ranks do not make data-parallel groups of tp{tp} x pp{pp}")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    return Layout(
        tp=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp=pp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )
