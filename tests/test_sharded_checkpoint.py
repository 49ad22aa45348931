"""Sharded asynchronous recover checkpoints (train.sharded): FSDP2 models and AdamW on gloo ranks (CPU), saved
in the background while training goes on, loaded by the same or another number of ranks."""

from __future__ import annotations

import atexit
import json
import os
import signal
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from areal_hpc.control.manifest import sha256_file
from areal_hpc.train import dist, sharded
from areal_hpc.train.sharded import AsyncSave, load

# --- what a trainer rank does ------------------------------------------------------------------------------


def make_model(seed: int, sharded: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Three Linear layers (33 and 5 rows: uneven shards on two ranks), each and the root fully_shard'ed on
    the CPU (also where there is a GPU)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 33), nn.ReLU(), nn.Linear(33, 5))
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's batch of step `step` (the same on every run)."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(the tensors to checkpoint, the optimizer's param_groups for JSON), by parameter name."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"actor": {"model": model_state, "optimizer": optim_state["state"]}}, optim_state["param_groups"]


def resume(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> dict:
    """Load the checkpoint in `folder` into a fresh model and optimizer; returns the loaded state."""
    state, param_groups = checkpoint_state(model, optimizer)
    load(state, folder)
    optim_state = {"state": state["actor"]["optimizer"], "param_groups": param_groups}
    set_state_dict(model, optimizer, model_state_dict=state["actor"]["model"], optim_state_dict=optim_state)
    return state


def full(tree) -> dict[str, torch.Tensor]:
    """The nested tensors as flat full tensors (DTensors gathered: a collective)."""
    if isinstance(tree, torch.Tensor):
        return {"": (tree.full_tensor() if isinstance(tree, DTensor) else tree).detach().clone()}
    return {f"{k}/{sub}".rstrip("/"): v for k, value in tree.items() for sub, v in full(value).items()}


def assert_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


# --- ranks in processes ------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, init_file: str, backend: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, init_file, backend=backend, timeout_s=60)
    try:
        fn(*args)
        dist.barrier()  # no rank leaves while another's last collective is in flight (gloo aborts then)
    finally:
        dist.destroy()


def spawn(world: int, tmp: Path, fn, *args, backend: str = "gloo") -> None:
    """Run fn(*args) on `world` ranks, one process each."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_file = str(tmp / f"init-{uuid.uuid4().hex}")
    mp.spawn(_rank_main, args=(world, init_file, backend, fn, args), nprocs=world)


def negate(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.neg_()  # local to each shard, and exact: negating again restores the parameters


def _save(folder: Path, out: Path, sharded: bool) -> None:
    model, optimizer = make_model(seed=0, sharded=sharded)
    for step in range(2):
        train_step(model, optimizer, step)
    saver = AsyncSave()
    state, _ = checkpoint_state(model, optimizer)
    saved = full(state)
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0's writer waits for rank 1 in DCP's planning: rank 0 mutates before it writes
    saver.save(state, folder)
    negate(model)  # training goes on while the checkpoint is written: the staged copy must not change
    entries = saver.wait()
    saver.close()
    negate(model)
    train_step(model, optimizer, 2)
    after = full(dict(model.named_parameters()))
    (out / f"entries{dist.get_rank()}.json").write_text(json.dumps(entries))
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "after": after}, out / "expected.pt")


def _resume_and_step(folder: Path, out: Path, sharded: bool, step: bool = False) -> None:
    expected = torch.load(out / "expected.pt")
    model, optimizer = make_model(seed=1, sharded=sharded)
    assert_identical(full(resume(model, optimizer, folder)), expected["saved"])
    if step:  # the same ranks as the save: the same arithmetic
        train_step(model, optimizer, 2)
        assert_identical(full(dict(model.named_parameters())), expected["after"])


def save_on(world: int, tmp: Path, sharded: bool = True) -> SimpleNamespace:
    """A checkpoint saved by `world` ranks after two steps; what they saved, and their entries."""
    folder, out = tmp / "checkpoint", tmp / "out"
    out.mkdir()
    spawn(world, tmp, _save, folder, out, sharded)
    entries = [json.loads((out / f"entries{r}.json").read_text()) for r in range(world)]
    return SimpleNamespace(folder=folder, out=out, entries=entries)


@pytest.fixture(scope="module")
def by_two(tmp_path_factory) -> SimpleNamespace:
    return save_on(2, tmp_path_factory.mktemp("by_two"))


# --- the tests ---------------------------------------------------------------------------------------------


def test_two_ranks_resume_bit_for_bit(by_two, tmp_path):
    """Parameters and AdamW state come back exactly as staged (not as changed after save returned), and one
    more step gives the parameters the saving run had."""
    spawn(2, tmp_path, _resume_and_step, by_two.folder, by_two.out, True, True)


def test_two_ranks_to_one_plain_model(by_two, tmp_path):
    spawn(1, tmp_path, _resume_and_step, by_two.folder, by_two.out, False)


def test_one_rank_to_two(tmp_path):
    by_one = save_on(1, tmp_path)
    spawn(2, tmp_path, _resume_and_step, by_one.folder, by_one.out, True)


# torch's threads of gloo groups (workers, I/O loops) and of rank 0's TCPStore server, by name
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def group_threads() -> list[str]:
    tasks = Path("/proc/self/task")
    names = [(tasks / tid / "comm").read_text().strip() for tid in os.listdir(tasks)]
    return [name for name in names if name in GROUP_THREADS]


def _resume_then_destroy(folder: Path, out: Path) -> None:
    _resume_and_step(folder, out, True)
    dist.barrier()
    dist.destroy()  # _rank_main's barrier and destroy are then no-ops
    assert not group_threads(), group_threads()


def _hold_model_over_destroy(rank: int, world: int, init_file: str, folder: Path, out: Path) -> None:
    """A rank that still holds its model when it destroys the group: the group is freed at exit. The check
    is registered first, so that it runs after dist's own atexit handler."""
    atexit.register(lambda: (out / f"threads{rank}.json").write_text(json.dumps(group_threads())))
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, init_file, timeout_s=60)
    model, optimizer = make_model(seed=1)
    resume(model, optimizer, folder)
    dist.barrier()
    dist.destroy()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_no_group_thread_outlives_destroy_or_exit(by_two, tmp_path):
    """dist.destroy frees the group, although DTensor's caches keep the model's DeviceMesh (and so the group);
    a group the rank still holds is freed at exit. Otherwise a gloo worker that frees a completed collective
    late, while the interpreter shuts down, must take the GIL, is ended by pthread_exit inside a noexcept
    destructor, and the rank aborts ("terminate called without an active exception")."""
    spawn(2, tmp_path, _resume_then_destroy, by_two.folder, by_two.out)
    init_file = str(tmp_path / "init-held")
    mp.spawn(_hold_model_over_destroy, args=(2, init_file, by_two.folder, tmp_path), nprocs=2)
    assert [json.loads((tmp_path / f"threads{r}.json").read_text()) for r in range(2)] == [[], []]


def test_one_copy_of_the_state(by_two):
    saved = torch.load(by_two.out / "expected.pt")["saved"]
    state_bytes = sum(t.numel() * t.element_size() for t in saved.values())  # params, exp_avg(_sq), steps
    files = [p for p in by_two.folder.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert state_bytes < total < 1.1 * state_bytes, (total, state_bytes)


def test_entries_are_the_files_written(by_two):
    rank0, rank1 = (set(entries) for entries in by_two.entries)
    assert rank0 and rank1 and not rank0 & rank1
    on_disk = {p.relative_to(by_two.folder).as_posix() for p in by_two.folder.rglob("*") if p.is_file()}
    assert rank0 | rank1 == on_disk
    for entries in by_two.entries:
        for name, entry in entries.items():
            path = by_two.folder / name
            assert entry == {"size": path.stat().st_size, "sha256": sha256_file(path)}


def _save_to_unwritable(folder: Path) -> None:
    model, optimizer = make_model(seed=0)
    train_step(model, optimizer, 0)
    saver = AsyncSave()
    saver.save(checkpoint_state(model, optimizer)[0], folder)
    with pytest.raises(RuntimeError, match=str(folder)):
        saver.wait()
    saver.close()


def test_a_write_failure_is_raised_by_wait_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spawn(2, tmp_path, _save_to_unwritable, blocker / "checkpoint")  # its parent is no folder


def test_one_save_at_a_time_and_tensors_only(tmp_path):
    saver = AsyncSave()  # alone: no process group
    assert not saver.pending() and not saver.done() and saver.wait() == {}
    saver.save({"w": torch.ones(4, 3)}, tmp_path / "a")
    assert saver.pending()
    with pytest.raises(RuntimeError, match="wait"):
        saver.save({"w": torch.ones(4, 3)}, tmp_path / "b")
    deadline = time.monotonic() + 30
    while not saver.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.done() and set(saver.wait()) == {p.name for p in (tmp_path / "a").iterdir()}
    saver.save({"w": torch.full((4, 3), 2.0)}, tmp_path / "b")  # the next save, once waited for
    assert saver.wait() and not saver.pending()
    loaded = {"w": torch.zeros(4, 3)}
    load(loaded, tmp_path / "b")
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0))
    with pytest.raises(TypeError, match="'optimizer.param_groups'"):
        saver.save({"optimizer": {"param_groups": [{"lr": 1e-3}]}}, tmp_path / "c")
    saver.close()


def writer_process() -> mp.Process:
    (process,) = [p for p in mp.active_children() if p.name == "checkpoint-writer"]
    return process


@pytest.mark.parametrize("notice", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_the_writer_process_outlives_slurms_signals_and_leaves_no_shared_memory_file(tmp_path, notice):
    """Slurm signals every process of the step (a preemption's USR2 notice too); the checkpoint written on the
    signal is the writer's to finish."""
    saver = AsyncSave()
    saver.save({"w": torch.ones(256, 256)}, tmp_path / "a")  # the writer is up once a save returns
    os.kill(writer_process().pid, notice)
    assert saver.wait()
    time.sleep(0.2)
    saver.save({"w": torch.ones(256, 256)}, tmp_path / "b")
    assert saver.wait() and writer_process().is_alive()
    assert not list(sharded.SHM.glob(f"areal-checkpoint-{os.getpid()}-*"))  # unlinked once mapped
    saver.close()
    assert not [p for p in mp.active_children() if p.name == "checkpoint-writer"]


def test_a_dead_writer_process_is_raised(tmp_path):
    saver = AsyncSave()
    saver.reserve({"w": torch.ones(4, 3)})
    writer_process().kill()
    writer_process().join()
    with pytest.raises(RuntimeError, match="writer process .* died"):
        saver.save({"w": torch.ones(4, 3)}, tmp_path / "a")
    saver.close()


class Tied(nn.Module):
    """An LM's embedding and head sharing one weight (tie_word_embeddings), as the tiny model has."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def tied_round_trip(folder: Path, device: str) -> None:
    model, fresh = Tied(seed=0).to(device), Tied(seed=1).to(device)
    if dist.is_initialized():
        fully_shard(model)
        fully_shard(fresh)
    optimizer, fresh_optimizer = (torch.optim.AdamW(m.parameters()) for m in (model, fresh))
    model(torch.arange(10, device=device)).square().mean().backward()
    optimizer.step()
    saver = AsyncSave()
    state, _ = checkpoint_state(model, optimizer)
    saved = full(state)
    saver.save(state, folder)
    negate(model)
    assert saver.wait()
    saver.close()
    assert_identical(full(resume(fresh, fresh_optimizer, folder)), saved)


def test_tied_weights_in_several_files(tmp_path, monkeypatch):
    """Tensors sharing memory are written (safetensors refuses shared memory); FILE_BYTES bounds the files."""
    monkeypatch.setattr(sharded, "FILE_BYTES", 2000)  # the embedding has 3200 bytes
    tied_round_trip(tmp_path / "checkpoint", "cpu")
    assert len(list((tmp_path / "checkpoint").iterdir())) > 1


@pytest.mark.gpu
def test_cuda_shards_stage_to_cpu_and_load_back(tmp_path):
    """DTensors on the GPU, a training group on NCCL: staged to page-locked shared memory, written by the
    writer process."""
    spawn(1, tmp_path, tied_round_trip, tmp_path / "checkpoint", "cuda", backend="nccl")
