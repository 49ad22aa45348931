"""Recovery of `areal-hpc run`: a role killed mid-run, the attempt restarted, the run resumed from its newest
recover checkpoint, ending as if nothing had happened."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.control import fsio
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.status import get_status
from areal_hpc.launch.local import run_local
from areal_hpc.launch.rundir import run_dir_of
from areal_hpc.monitor.stats import read_stats
from tests.helpers import role_pids

STEPS = 6  # 4 prompts a step: 250 // 4 = 62 steps an epoch


def final_weights(run):
    (ckpt,) = sorted((run.root / "checkpoints" / "actor").iterdir(), key=lambda p: p.stat().st_mtime)[-1:]
    return load_file(ckpt / "model.safetensors")


def kill_at_step(run, role: str, step: int, timeout: float = 120.0) -> threading.Thread:
    """A thread that SIGKILLs `role` once the run has finished `step`."""

    def kill() -> None:
        deadline = time.monotonic() + timeout
        while (fsio.read_json(run.progress) or {}).get("step", 0) < step:
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
            time.sleep(0.05)
        os.kill(role_pids(run.root)[role], signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def assert_exactly_once(run, steps: int, batch: int) -> None:
    records = list(Ledger(run.root).records())
    assert sorted(r.step for r in records) == list(range(1, steps + 1))
    used = Counter(i for r in records for i in r.ids)
    assert len(used) == steps * batch and max(used.values()) == 1  # one epoch: no prompt twice
    assert [r["step"] for r in read_stats(run.stats) if "timeperf/e2e" in r] == list(range(1, steps + 1))


def test_a_killed_controller_resumes_and_ends_bit_for_bit_as_an_uninterrupted_run(toy):
    common = ["exp_ctrl.ckpt_freq_steps=2", "recover_after=0", "dataset.valid_path=null"]
    straight = toy.config("straight", STEPS, *common)
    assert run_local(straight) == 0

    killed = toy.config("killed", STEPS, *common)
    killer = kill_at_step(run_dir_of(killed), "controller", 3)  # the newest checkpoint is step 2's
    assert run_local(killed) == 0
    killer.join()

    run = run_dir_of(killed)
    assert get_status(run.root).state == "COMPLETE"
    assert (run.attempt_logs(1) / "controller.log").is_file()
    assert "resumes from recover checkpoint" in (run.attempt_logs(1) / "controller.log").read_text()
    assert_exactly_once(run, STEPS, 4)
    expected, got = final_weights(run_dir_of(straight)), final_weights(run)
    assert all(expected[k].equal(got[k]) for k in expected), (
        "resumed weights differ from the uninterrupted run"
    )


@pytest.mark.parametrize("victim", ["trainer0", "gen_server0"])
def test_a_killed_trainer_or_server_is_restarted_and_the_run_completes(toy, victim):
    cfg = toy.config(f"kill-{victim.replace('_', '-')}", 4, "exp_ctrl.ckpt_freq_steps=1", "recover_after=0")
    killer = kill_at_step(run_dir_of(cfg), victim, 2)
    assert run_local(cfg) == 0
    killer.join()
    run = run_dir_of(cfg)
    assert run.attempt_logs(1).is_dir() and not run.attempt_logs(2).exists()
    assert_exactly_once(run, 4, 4)


def test_an_asynchronous_run_resumes_with_the_same_ledger_and_close_weights(toy):
    # eta = 0 without interruption: each step's prompts are fixed, so two runs can be compared step by step.
    common = [
        "async_rl=true", "max_head_offpolicyness=0", "interruptible_generation=false", "n_rollout_workers=1",
        "cluster.n_nodes=1", "cluster.n_gpus_per_node=2", "exp_ctrl.ckpt_freq_steps=2", "recover_after=0",
        "dataset.valid_path=null",
    ]  # fmt: skip
    straight = toy.config("async-straight", STEPS, *common)
    assert run_local(straight) == 0
    killed = toy.config("async-killed", STEPS, *common)
    killer = kill_at_step(run_dir_of(killed), "controller", 3)
    assert run_local(killed) == 0
    killer.join()

    run = run_dir_of(killed)
    assert run.attempt_logs(1).is_dir()
    assert_exactly_once(run, STEPS, 4)
    by_step = [{r.step: set(r.ids) for r in Ledger(d.root).records()} for d in (run_dir_of(straight), run)]
    assert by_step[0] == by_step[1]
    expected, got = final_weights(run_dir_of(straight)), final_weights(run)
    assert all(torch.allclose(expected[k], got[k], atol=1e-5) for k in expected)

