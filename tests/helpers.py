"""Helpers of the tests: the toy experiment's settings, the role processes of a run, a probe of the tensors
an op makes, what TensorBoard reads from a run, and shared storage that refuses file locks."""

from __future__ import annotations

import fcntl
import os
import platform
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from areal_hpc.reward import jail

REPO_ROOT = Path(__file__).resolve().parents[1]


class Toy:
    """The toy experiment (configs/toy-cpu.yaml) on the tiny model and easy data, with tiny batches so that a
    step takes about a second, its runs under `fileroot`."""

    def __init__(self, fileroot: Path, model_dir: Path, data: Path):
        self.fileroot, self.model_dir, self.data = fileroot, model_dir, data

    def overrides(self, trial: str, steps: int, *extra: str) -> list[str]:
        return [
            f"cluster.fileroot={self.fileroot}",
            f"trial_name={trial}",
            f"actor.path={self.model_dir}",
            f"dataset.path={self.data / 'train.jsonl'}",
            f"dataset.valid_path={self.data / 'test.jsonl'}",
            "dataset.train_bs_n_seqs=4",
            "group_size=2",
            "ppo.gen.max_new_tokens=6",
            f"exp_ctrl.benchmark_steps={steps}",
            *extra,
        ]

    def config(self, trial: str, steps: int, *extra: str):
        from areal_hpc.config import load_config

        return load_config([REPO_ROOT / "configs" / "toy-cpu.yaml"], self.overrides(trial, steps, *extra))


def role_pids(run_root: Path) -> dict[str, int]:
    """pid of each role process of a run, from /proc."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv if a]
        if "areal_hpc.launch.roles" in args and str(run_root) in args:
            role = next(a for a in args if a in ("controller", "gen_server", "trainer", "rollout"))
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
            index = "" if role in ("controller", "rollout") else env[b"SUBMITIT_LOCAL_GLOBALID"].decode()
            pids[role + index] = int(proc.name)
    return pids


def child_pids(pid: int) -> list[int]:
    """pids of the processes whose parent is `pid`, from /proc."""
    children = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # after "pid (comm) state": the parent's pid
            children.append(int(proc.name))
    return children


class OutputProbe(TorchDispatchMode):
    """Records, over every op run under it (forward and backward), the largest output's numel and the peak
    of the bytes held by live op outputs (tensors saved for backward included; views and in-place results,
    which share an input's storage, are not counted again). CPU-only, no allocator hooks needed."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}
        self._bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if not torch.is_tensor(t):
                continue
            self.largest = max(self.largest, t.numel())
            key = _storage(t)
            size = 0 if key is None else t.untyped_storage().nbytes()
            if key in inputs or key in self._live or size == 0:
                continue
            self._live[key] = size
            self._bytes += size
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            weakref.finalize(t, self._free, key)
        return out

    def _free(self, key):
        self._bytes -= self._live.pop(key)


def _storage(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage; None for one without (FSDP frees unsharded parameters' storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each scalar in the event files of `folder`, as TensorBoard's own reader loads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# --- file locks refused, as on shared storage ---------------------------------------------------------------


_FLOCK_SYSCALL = {"x86_64": 73, "aarch64": 32}
CAN_REFUSE_FLOCK = platform.system() == "Linux" and platform.machine() in _FLOCK_SYSCALL


def refuse_flock(err: int) -> None:
    """From now on every flock() of this process fails with ``err``: ENOSYS as on Lustre mounted without
    flock, ENOLCK as on NFS without a lock daemon. A seccomp filter: it cannot be undone, so only a child
    process may call this."""
    load_nr, jeq, ret = 0x20, 0x15, 0x06
    program = [
        jail.bpf(load_nr, 0),
        jail.bpf(jeq, _FLOCK_SYSCALL[platform.machine()], jf=1),
        jail.bpf(ret, 0x00050000 | err),  # SECCOMP_RET_ERRNO
        jail.bpf(ret, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    ]
    if not jail.install_filter(b"".join(program)):
        raise OSError("cannot install the seccomp filter that refuses flock")
    with open(os.devnull) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as exc:
            assert exc.errno == err, exc
        else:
            raise AssertionError("flock still works after the filter")


def pids_with_arg(*args: str) -> list[int]:
    """pids of the processes one of whose arguments is one of `args`, whole (a run directory: its roles, and
    agent programs given it; not a launcher whose override holds it), from /proc."""
    wanted = {a.encode() for a in args}
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted.intersection(argv):
            pids.append(int(proc.name))
    return pids
