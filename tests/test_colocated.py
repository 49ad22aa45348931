"""Colocated generation (allocation_mode a bare 3D spec): the server shares the trainer's device and takes turns
with it, releasing its memory while the trainer trains (master/turns.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats

REWARD = "ppo_actor/task_reward/avg"


def final_weights(run) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run.root / "checkpoints" / "actor").iterdir())[-1:]
    return load_file(ckpt / "model.safetensors")


def test_colocated_steps_are_the_decoupled_synchronous_steps(toy):
    """Releasing, resuming and taking the trainer's shared weights between the steps loses nothing: the same
    seed trains the same weights as with a server of its own that loads snapshots from disk."""
    common = ["cluster.n_nodes=1", "cluster.n_gpus_per_node=2"]
    decoupled = toy.config("decoupled", 3, *common, "weight_update_mode=disk")
    colocated = toy.config("colocated", 3, *common, "allocation_mode=d1p1m1", "weight_update_mode=tensor")
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
