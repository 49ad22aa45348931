"""Recovery of `areal-hpc run`: a role killed mid-run, the attempt restarted, the run resumed from its newest
recover checkpoint, ending as if nothing had happened."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.control import fsio
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.control.status import get_status
from areal_hpc.launch.local import run_local
from areal_hpc.launch.run_status import status_lines
from areal_hpc.monitor import read_timeline, steps_of
from areal_hpc.monitor.stats import read_stats
from tests.helpers import child_pids, role_pids

STEPS = 6  # 4 prompts a step: 250 // 4 = 62 steps an epoch


def final_weights(run):
    (ckpt,) = sorted((run.root / "checkpoints" / "actor").iterdir(), key=lambda p: p.stat().st_mtime)[-1:]
    return load_file(ckpt / "model.safetensors")


def kill_at_step(
    run, role: str, step: int, sig: int = signal.SIGKILL, timeout: float = 120.0
) -> threading.Thread:
    """A thread that sends `sig` to `role` once the run has finished `step`."""

    def kill() -> None:
        deadline = time.monotonic() + timeout
        while (fsio.read_json(run.progress) or {}).get("step", 0) < step:
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
            time.sleep(0.05)
        os.kill(role_pids(run.root)[role], sig)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def assert_exactly_once(run, steps: int, batch: int, epochs: int = 1) -> None:
    """Every step recorded once, and within each epoch no prompt used twice."""
    records = list(Ledger(run.ledger).records())
    assert sorted({r.step for r in records}) == list(range(1, steps + 1))
    for epoch in range(epochs):
        used = Counter(i for r in records if r.epoch == epoch for i in r.ids)
        assert sum(used.values()) == steps // epochs * batch and max(used.values()) == 1, used
    assert [r["step"] for r in read_stats(run.stats) if "timeperf/e2e" in r] == list(range(1, steps + 1))


def straight_and_killed(toy, prefix: str, *common: str):
    """The run directories of the same run twice: uninterrupted, and with its controller killed after step 3."""
    straight = toy.config(f"{prefix}straight", STEPS, *common)
    assert run_local(straight) == 0
    killed = toy.config(f"{prefix}killed", STEPS, *common)
    killer = kill_at_step(run_dir_of(killed), "controller", 3)
    assert run_local(killed) == 0
    killer.join()
    return run_dir_of(straight), run_dir_of(killed)


def test_a_killed_controller_resumes_and_ends_bit_for_bit_as_an_uninterrupted_run(toy, tmp_path):
    # 10 prompts, 4 a step: 2 steps an epoch, 3 epochs; the checkpoint used is step 2's, at an epoch boundary.
    ten = tmp_path / "ten.jsonl"
    ten.write_text("".join((toy.data / "train.jsonl").read_text().splitlines(keepends=True)[:10]))
    common = [
        f"dataset.path={ten}", "exp_ctrl.total_train_epochs=3", "exp_ctrl.benchmark_steps=null",
        "exp_ctrl.ckpt_freq_steps=2", "recover_after=0", "dataset.valid_path=null",
    ]  # fmt: skip
    straight, run = straight_and_killed(toy, "", *common)
    assert get_status(run).state == "COMPLETE"
    log = (run.attempt_logs(1) / "controller.log").read_text()
    assert "resumes from recover checkpoint" in log and "step00000002" in log
    assert_exactly_once(run, STEPS, 4, epochs=3)
    expected, got = final_weights(straight), final_weights(run)
    assert all(expected[k].equal(got[k]) for k in expected), (
        "resumed weights differ from the uninterrupted run"
    )


def test_usr2_checkpoints_at_the_end_of_the_step_and_the_next_attempt_resumes_there(toy):
    # No periodic checkpoints: the only one is the notice's.
    cfg = toy.config(
        "usr2", 5, "exp_ctrl.ckpt_freq_secs=null", "exp_ctrl.ckpt_freq_steps=null", "recover_after=0",
        "dataset.valid_path=null",
    )  # fmt: skip
    sender = kill_at_step(run_dir_of(cfg), "controller", 2, signal.SIGUSR2)
    assert run_local(cfg) == 0
    sender.join()
    run = run_dir_of(cfg)
    first, second = ((run.attempt_logs(a) / "controller.log").read_text() for a in (0, 1))
    assert "Dumped recover info to file." in first and "Preempted" in first
    assert "resumes from recover checkpoint" in second
    assert_exactly_once(run, 5, 4)
    # The timeline keeps both attempts: the steps of the first, then those the second ran.
    events, _ = read_timeline(run.timeline)
    steps = [(s.attempt, s.step) for s in steps_of(events)]
    first, second = ([step for a, step in steps if a == attempt] for attempt in (0, 1))
    assert steps == [(0, s) for s in first] + [(1, s) for s in second], steps
    assert first == list(range(1, len(first) + 1)) and second == list(range(len(first) + 1, 6)), steps
    assert {e.task for e in events if e.attempt == 1} >= {"controller", "trainer0", "gen_server0"}
    assert re.search(
        r"recover checkpoint: global step [23], written \d+:\d\d:\d\d ago", "\n".join(status_lines(run))
    )


@pytest.mark.slow  # on Slurm: test_slurm_requeue's scontrol requeue (SIGTERM to every task) in make test
def test_sigterm_to_every_role_checkpoints_the_last_finished_step_and_the_next_attempt_resumes_there(toy):
    # As Slurm stops a job (scancel, requeue, preemption): every process of every task gets SIGTERM at once,
    # the trainers' checkpoint writers too. No periodic checkpoints, so the resume point can only be the one
    # written on SIGTERM.
    cfg = toy.config(
        "term", 5, "exp_ctrl.ckpt_freq_secs=null", "exp_ctrl.ckpt_freq_steps=null", "recover_after=0",
        "dataset.valid_path=null",
    )  # fmt: skip
    run = run_dir_of(cfg)
    stopped = []

    def term_everyone() -> None:
        while (fsio.read_json(run.progress) or {}).get("step", 0) < 2:
            time.sleep(0.05)
        roles = role_pids(run.root)
        for pid in [*roles.values(), *child_pids(roles["trainer0"])]:
            os.kill(pid, signal.SIGTERM)
        stopped.append(fsio.read_json(run.progress)["step"])

    sender = threading.Thread(target=term_everyone, daemon=True)
    sender.start()
    assert run_local(cfg) == 0
    sender.join()
    first, second = ((run.attempt_logs(a) / "controller.log").read_text() for a in (0, 1))
    assert "SIGTERM: writing a recover checkpoint" in first and "Preempted" in first, first
    (step,) = map(int, re.findall(r"Dumped recover info to file. \(global step (\d+)", first))
    assert step >= stopped[0]  # nothing finished before the signal is lost
    assert f"resumes from recover checkpoint {run.root / 'recover' / f'step{step:08d}'}" in second, second
    assert "SIGTERM: serving on" in (run.attempt_logs(0) / "trainer0.log").read_text()
    assert "the trainer ranks wrote their shards in" in first
    assert_exactly_once(run, 5, 4)


# A killed trainer: on Slurm test_slurm_requeue.py (make test); its local variants here, and the megatron one
# below, run with the slow tests (make test-slow).
@pytest.mark.parametrize("victim", [pytest.param("trainer0", marks=pytest.mark.slow), "gen_server0"])
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
    straight, run = straight_and_killed(toy, "async-", *common)
    assert run.attempt_logs(1).is_dir()
    assert_exactly_once(run, STEPS, 4)
    by_step = [{r.step: set(r.ids) for r in Ledger(d.ledger).records()} for d in (straight, run)]
    assert by_step[0] == by_step[1]
    expected, got = final_weights(straight), final_weights(run)
    assert all(torch.allclose(expected[k], got[k], atol=1e-5) for k in expected)


@pytest.mark.slow  # the megatron engine's own resume is pinned bit for bit in test_megatron_engine
def test_a_killed_tensor_parallel_megatron_trainer_resumes_from_its_recover_checkpoint(toy):
    tp2 = ("allocation_mode=builtin.d1p1m1+d1p1m2", "cluster.n_nodes=1", "cluster.n_gpus_per_node=3")
    cfg = toy.config("kill-megatron", 4, *tp2, "actor.backend=megatron", "exp_ctrl.ckpt_freq_steps=1",
                     "recover_after=0")  # fmt: skip
    killer = kill_at_step(run_dir_of(cfg), "trainer1", 2)  # the TP peer of rank 0
    assert run_local(cfg) == 0
    killer.join()
    run = run_dir_of(cfg)
    assert "resumes from recover checkpoint" in (run.attempt_logs(1) / "controller.log").read_text()
    assert_exactly_once(run, 4, 4)
