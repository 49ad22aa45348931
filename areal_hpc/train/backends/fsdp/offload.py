"""``optimizer.offload``: AdamW's state in CPU memory, streamed to the device one parameter at a time for the
update, so the device holds weights and gradients only (a 7B model's 61 GB of moments stay in host memory).

- The state is made up front (``make_home``), where its first step would have made it on the device: torch's
  checkpoint functions make missing state with a zero-gradient step of the whole model on the device.
- One CPU buffer of the exact size holds it, page-locked on a GPU (``cudaHostRegister``): torch's pinned
  allocator rounds every tensor up to a power of two (up to twice the host memory).
- A recover checkpoint loads into that buffer in place (``load_home``): torch's ``load_state_dict`` would put
  every moment on its parameter's device.
- Each local shard lives on the CPU under its parameter's placements, as FSDP2's own CPU offload keeps its
  shards: ``DTensor.from_local`` would move it back to the mesh's device.
"""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")
IN_FLIGHT = 2 << 30  # bytes of moments on the device at once: a few 7B layers' weights, beside the grads


def make_home(optimizer: torch.optim.AdamW, pinned: bool) -> None:
    """Every parameter's AdamW state as its first step would make it (step 0, zero moments), in CPU memory."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(group["amsgrad"] or group["fused"] or group["capturable"] for group in optimizer.param_groups):
        raise ValueError("optimizer.offload keeps plain AdamW's state: no amsgrad, fused or capturable")
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("optimizer.offload needs float32 trained weights (the masters)")
    sizes = [_local(p).numel() for p in params for _ in MOMENTS]
    views = iter(_zeros(sum(sizes), pinned).split(sizes))
    for p in params:
        shape = _local(p).shape
        moments = {key: _as(p, next(views).view(shape)) for key in MOMENTS}
        optimizer.state[p] = {"step": torch.tensor(0.0), **moments}


def load_home(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """``saved`` (optimizer state by parameter name, as ``get_optimizer_state_dict`` names it) copied into the
    CPU state in place. A recover load reads into that state itself: then there is nothing to copy."""
    for name, home in get_optimizer_state_dict(model, optimizer)["state"].items():
        for key, tensor in home.items():
            if saved[name][key] is not tensor:
                _local(tensor).copy_(_local(saved[name][key]))


def offloaded_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    device: torch.device,
    in_flight: int = IN_FLIGHT,
) -> None:
    """The optimizer's step one parameter at a time, its moments copied to the device and back. On a GPU the
    copies in and out run on streams of their own beside the update, so PCIe carries both ways at once (a 7B
    step moves 61 GB each way), and Python waits only when ``in_flight`` bytes of moments are on the device."""
    lanes = _Lanes(device, in_flight) if device.type == "cuda" else None
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    for p, grad in zip(params, grads, strict=True):
        home = optimizer.state[p]  # "step" stays where AdamW keeps it (a CPU scalar), advanced in place
        moments = {key: home[key] for key in MOMENTS}
        optimizer.state[p] = {**home, **(lanes.fetch(moments) if lanes else moments)}
        p.grad = grad
        optimizer.step()
        p.grad = None
        if lanes:
            lanes.store({key: optimizer.state[p][key] for key in MOMENTS}, moments)
        optimizer.state[p] = home
    if lanes:  # the CPU state whole before anything reads it (a checkpoint, the next step)
        lanes.drain()
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


class _Lanes:
    """The two copy streams of ``offloaded_step`` and the bytes of moments they have on the device."""

    def __init__(self, device: torch.device, in_flight: int):
        self.compute = torch.cuda.current_stream(device)
        self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.device, self.limit = device, in_flight
        self.pending: deque[tuple[torch.cuda.Event, int]] = deque()  # copies back not yet known done

    def fetch(self, homes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The moments on the device, for the compute stream; waits while too many are still there."""
        nbytes = sum(_local(t).nbytes for t in homes.values())
        while self.pending and sum(n for _, n in self.pending) + nbytes > self.limit:
            self.pending.popleft()[0].synchronize()
        # Made on the compute stream, whose cache the activations share; the copy in waits for the updates
        # queued there, which may still use that memory (a few ms against a copy's tens).
        moved = {key: _as(t, torch.empty_like(_local(t), device=self.device)) for key, t in homes.items()}
        self.up.wait_stream(self.compute)
        with torch.cuda.stream(self.up):
            for key, t in moved.items():
                _local(t).copy_(_local(homes[key]), non_blocking=True)
        self.compute.wait_stream(self.up)
        return moved

    def store(self, moved: dict[str, torch.Tensor], homes: dict[str, torch.Tensor]) -> None:
        """The updated moments copied back into their CPU homes once the compute stream has made them."""
        self.down.wait_stream(self.compute)
        with torch.cuda.stream(self.down):
            for key, t in moved.items():
                _local(homes[key]).copy_(_local(t), non_blocking=True)
                _local(t).record_stream(self.down)
            done = torch.cuda.Event()
            done.record(self.down)
        self.pending.append((done, sum(_local(t).nbytes for t in moved.values())))

    def drain(self) -> None:
        self.down.synchronize()
        self.pending.clear()


def _zeros(numel: int, pinned: bool) -> torch.Tensor:
    """``numel`` float32 zeros in CPU memory, page-locked if ``pinned`` for as long as any view of them lives."""
    owner = np.zeros(numel, dtype=np.float32)  # its pages are touched when locked, or by the first step
    flat = torch.from_numpy(owner)  # the tensor's storage keeps ``owner`` alive
    if pinned and numel:
        address, cudart = flat.data_ptr(), torch.cuda.cudart()
        error = cudart.cudaHostRegister(address, flat.nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(
                f"page-locking {flat.nbytes / 1e9:.1f} GB of optimizer state: CUDA error {error}"
            )
        # numpy clears an array's weak references before it frees the memory: unlocked, then freed
        weakref.finalize(owner, cudart.cudaHostUnregister, address).atexit = False
    return flat


def _as(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``like``'s shard (same mesh and placements) wherever it lives; plain if ``like`` is."""
    return DTensor(local, like._spec, requires_grad=False) if isinstance(like, DTensor) else local


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
