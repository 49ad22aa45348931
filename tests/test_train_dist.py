"""The trainers' process group: which GPU a rank takes, and how the ranks meet through the run directory."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.control import ControlTimeout, fsio
from areal_hpc.train import dist
from tests.helpers import CAN_REFUSE_FLOCK, refuse_flock


@pytest.fixture
def no_launcher_env(monkeypatch):
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)


def test_a_task_bound_to_one_gpu_takes_device_0_whatever_its_index_on_the_node(no_launcher_env, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "3")  # --gpus-per-task=1: the fourth task of the node sees one GPU
    assert dist.device_index(dist.local_rank(rank=7), visible=1) == 0


def test_a_task_that_sees_every_gpu_of_its_node_takes_its_own(no_launcher_env, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert dist.device_index(dist.local_rank(rank=7), visible=4) == 3


def test_without_a_launcher_the_rank_picks_among_the_visible_gpus(no_launcher_env):
    assert dist.local_rank(rank=5) == 5
    assert dist.device_index(5, visible=4) == 1
    assert dist.device_index(5, visible=0) == 0  # no GPU: nothing to choose


# --- meeting through the run directory --------------------------------------------------------------------


def _rank_without_flock(rank: int, meeting: str, out: str) -> None:
    refuse_flock(errno.ENOSYS)  # as Lustre mounted without flock does
    dist.init_distributed(rank, 3, meeting, backend="gloo", timeout_s=60, attempt=2)
    try:
        total = dist.all_reduce_sum(torch.tensor([rank + 1.0]))
        Path(out, f"rank{rank}").write_text(str(total.item()))
    finally:
        dist.destroy()


@pytest.mark.skipif(not CAN_REFUSE_FLOCK, reason="no seccomp filter for flock on this machine")
def test_ranks_meet_through_the_run_directory_without_file_locks(tmp_path):
    meeting = tmp_path / "dist_init.json"
    fsio.write_json(meeting, {"host": "127.0.0.1", "port": 1, "attempt": 1})  # the last attempt's
    mp.spawn(_rank_without_flock, args=(str(meeting), str(tmp_path)), nprocs=3)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == ["6.0"] * 3
    assert fsio.read_json(meeting)["attempt"] == 2


def test_a_rank_waiting_for_rank_0_names_the_file_and_the_attempt(tmp_path):
    meeting = tmp_path / "dist_init.json"
    fsio.write_json(meeting, {"host": "127.0.0.1", "port": 1, "attempt": 0})  # the last attempt's
    waited_for = f"trainer rank 0 to write .* attempt 1 to {re.escape(str(meeting))}"
    joined = dist.is_initialized()  # an earlier test of this process may have made a group of one
    with pytest.raises(ControlTimeout, match=waited_for):
        dist.init_distributed(1, 2, meeting, backend="gloo", timeout_s=0.3, attempt=1)
    assert dist.is_initialized() == joined  # no group joined
