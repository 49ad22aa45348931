"""Colocated generation (allocation_mode a bare 3D spec): the server shares the trainer's device and takes turns
with it, releasing its memory while the trainer trains (master/turns.py)."""

from __future__ import annotations

from collections import Counter

import torch
from safetensors.torch import load_file

from areal_hpc.alloc import resolve_allocation
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor import read_timeline
from areal_hpc.monitor.stats import read_stats
from areal_hpc.weights.publisher import share_sources

REWARD = "ppo_actor/task_reward/avg"


def final_weights(run) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run.root / "checkpoints" / "actor").iterdir())[-1:]
    return load_file(ckpt / "model.safetensors")


def test_colocated_steps_are_the_decoupled_synchronous_steps(toy):
    """Releasing, resuming and taking the trainers' shared weights between the steps loses nothing: the same
    seed trains the same weights as with servers of their own that load snapshots from disk. Two trainer
    ranks and two servers: each server copies the weights from the rank on its own device."""
    decoupled = toy.config("decoupled", 3, "cluster.n_nodes=1", "cluster.n_gpus_per_node=4",
                           "allocation_mode=builtin.d2p1m1+d2p1m1", "weight_update_mode=disk")  # fmt: skip
    colocated = toy.config("colocated", 3, "cluster.n_nodes=1", "cluster.n_gpus_per_node=2",
                           "allocation_mode=d2p1m1", "weight_update_mode=tensor")  # fmt: skip
    assert run_local(decoupled) == 0 and run_local(colocated) == 0
    apart, shared = (read_stats(run_dir_of(c).stats) for c in (decoupled, colocated))
    steps = [r for r in shared if REWARD in r]
    assert [r[REWARD] for r in steps] == [r[REWARD] for r in apart if REWARD in r]
    assert all(r["timeperf/release_memory"] > 0 and r["timeperf/resume_memory"] > 0 for r in steps)
    assert not any("timeperf/release_memory" in r for r in apart)
    assert all(r["weight_sync/bytes"] > 0 for r in steps)  # shared, not written: no snapshot on disk
    assert not list(run_dir_of(colocated).weights.glob("v*"))
    expected = final_weights(run_dir_of(decoupled))
    for name, tensor in final_weights(run_dir_of(colocated)).items():
        assert torch.equal(tensor, expected[name]), name
    events, _ = read_timeline(run_dir_of(colocated).timeline)
    shared = Counter(e.task for e in events if e.name == "weights_shared")
    assert shared == {"trainer0": 3, "trainer1": 3}  # a publication a step, from both ranks


def test_each_colocated_server_copies_from_the_trainer_rank_on_its_gpus():
    assert share_sources(resolve_allocation("d2p1m1", 1, 2).gen_servers(), 2) == [[0], [1]]
    assert share_sources(resolve_allocation("d2p1m2", 1, 4).gen_servers(), 4) == [[0, 1], [2, 3]]
    two_nodes = resolve_allocation("actor_train:d1p2m2,*:d2p1m2", 2, 2)
    assert share_sources(two_nodes.gen_servers(), 4) == [[0, 1], [2, 3]]
