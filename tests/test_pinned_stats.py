"""A fixed-seed 3-step toy run gives the very losses and rewards that were pinned (as torchtitan pins its
losses): a refactor of the loop, the roles or the backends must not change a single number.

    AREAL_UPDATE_PINS=1 pytest tests/test_pinned_stats.py   # re-pin, after a change that is meant to

The pins hold for the torch build and CPU kernels they were made with (same machine class as CI); elsewhere
the test is skipped, since other kernels round differently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats

PINS = Path(__file__).parent / "golden" / "pinned-stats.json"
# Synchronous PPO with two trainer ranks (the gradient all-reduce) and a reference model, and the supervised
# warm-up. Unnormalised advantages: the untrained model's constant reward then moves it. The server decodes
# one group at a time: rows batched with other requests round differently from run to run.
# Each on both training backends: the sharded default and the replicated one.
PPO = (
    "allocation_mode=builtin.d1p1m1+d2p1m1", "cluster.n_nodes=1", "cluster.n_gpus_per_node=3",
    "ppo.adv_norm=false", "ppo.group_adv_norm=false", "ppo.kl_ctl=0.05", "max_running_requests=2",
)  # fmt: skip
SFT = ("experiment_type=sft",)
RUNS = {
    "ppo": PPO,
    "sft": SFT,
    "ppo-torch": (*PPO, "actor.backend=torch", "ref.backend=torch"),
    "sft-torch": (*SFT, "actor.backend=torch"),
}
TIMING = ("time", "timeperf/", "rollout/gen_tokens_per_s", "rollout/gen_secs")  # differ from run to run


def machine() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def pinned_numbers(toy, name: str) -> list[dict]:
    cfg = toy.config(f"pin-{name}", 3, *RUNS[name], "recover_mode=disabled")
    assert run_local(cfg) == 0
    rows = read_stats(run_dir_of(cfg).stats)
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_three_step_toy_run_gives_the_pinned_numbers(toy, name):
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {"machine": machine(), "runs": {}}
    got = pinned_numbers(toy, name)
    if os.environ.get("AREAL_UPDATE_PINS") == "1":
        pins["machine"], pins["runs"][name] = machine(), got
        PINS.write_text(json.dumps(pins, indent=1) + "\n")
        return
    if pins["machine"] != machine():
        pytest.skip(f"pinned with {pins['machine']}, this machine has {machine()}")
    assert got == pins["runs"][name]  # bit for bit: floats compare exactly
