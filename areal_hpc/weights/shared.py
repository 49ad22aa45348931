"""Weights handed to a server on the same host without a copy in between: SGLang's ``update_weights_from_tensor``.

The sender pickles ``[(name, tensor), ...]`` with torch's multiprocessing reductions (``ForkingPickler``): a CUDA
tensor travels as a CUDA IPC handle of its memory, a CPU tensor as the name of a shared-memory file; the text is
base64, one entry of ``serialized_named_tensors`` per TP rank of the server, as SGLang's
``MultiprocessingSerializer`` makes it. The receiver maps the memory and copies from it. The sender must keep its
tensors until every receiver answered (``SharedWeights`` holds them).

Unpickling runs code named by the payload, so the receiver allows only torch's tensor and storage rebuilders
and dtypes: a payload naming anything else is refused before anything runs (the route also needs the run's token).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions

NamedTensors = list[tuple[str, torch.Tensor]]


@contextmanager
def _file_system_sharing():
    """CPU tensors shared by file name: the default (file descriptors) reaches only our own child processes."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


# A CUDA tensor's device travels as its GPU's UUID, not its index (SGLang's convention): two processes of one
# node may number its GPUs differently (CUDA_VISIBLE_DEVICES of their Slurm steps).
_DEVICE_ARG = 6  # of torch's rebuild_cuda_tensor


class _Pickler(ForkingPickler):
    def reducer_override(self, obj):
        if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
            return NotImplemented
        rebuild, args = reductions.reduce_tensor(obj)
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        return rebuild, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])


def _rebuild_cuda_tensor(*args):
    """torch's rebuild_cuda_tensor, the device given by its UUID."""
    uuid = args[_DEVICE_ARG]
    if isinstance(uuid, str):
        index = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if uuid not in index:
            raise ValueError(f"the tensors are on GPU {uuid}, which this process does not see")
        args = (*args[:_DEVICE_ARG], index.index(uuid), *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def serialize(named: NamedTensors) -> str:
    """``named`` as one entry of ``serialized_named_tensors`` (base64 of a ForkingPickler dump)."""
    buf = io.BytesIO()
    with _file_system_sharing():
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_TORCH_TYPES = {"Tensor", "Size", "device", "UntypedStorage", "TypedStorage"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (module in ("torch", "torch._tensor", "torch.storage") and name in _TORCH_TYPES)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            or (module == "torch._utils" and name == "_rebuild_tensor_v2")
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"refused: the payload names {module}.{name}, not a tensor's rebuilder"
            )
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        return super().find_class(module, name)


def deserialize(text: str) -> NamedTensors:
    """The ``(name, tensor)`` list of one ``serialize``d entry; ValueError when it is not one."""
    try:
        named = _Unpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"not a serialized list of named tensors: {exc}") from exc
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise ValueError("not a list of (name, tensor) pairs")
    return named


class SharedWeights:
    """The sender's end: the tensors it shares, held until ``release``."""

    def __init__(self) -> None:
        self.named: NamedTensors = []

    def share(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Hold ``weights`` (contiguous) and serialize them; ``{"serialized", "bytes"}``."""
        self.release()
        self.named = [(name, t.detach().contiguous()) for name, t in weights]
        return {"serialized": serialize(self.named), "bytes": sum(t.nbytes for _, t in self.named)}

    def release(self) -> None:
        """Drop the shared tensors (every receiver has copied them); their GPU memory goes back at once."""
        if not self.named:
            return
        cuda = any(t.is_cuda for _, t in self.named)
        self.named = []
        if cuda:
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
