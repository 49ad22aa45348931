"""`areal-hpc submit` on the real local Slurm cluster: the toy as one heterogeneous job, stop, a crash, two jobs."""

from __future__ import annotations

import getpass
import os
import signal
import time
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control import fsio
from areal_hpc.control.status import get_status
from areal_hpc.launch import runs, slurm, submit
from areal_hpc.monitor.stats import read_stats

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]


def toy_overrides(tmp_path: Path, tiny_model_dir: Path, data: Path, trial: str, steps: int) -> list[str]:
    return [
        f"cluster.fileroot={tmp_path}",
        f"trial_name={trial}",
        f"actor.path={tiny_model_dir}",
        f"dataset.path={data / 'train.jsonl'}",
        f"dataset.valid_path={data / 'test.jsonl'}",
        "dataset.train_bs_n_seqs=4",
        "group_size=2",
        "ppo.gen.max_new_tokens=6",
        f"exp_ctrl.benchmark_steps={steps}",
    ]


def submit_toy(tmp_path: Path, tiny_model_dir: Path, data: Path, trial: str, steps: int, *extra: str):
    overrides = [*toy_overrides(tmp_path, tiny_model_dir, data, trial, steps), *extra]
    sub = submit.prepare(load_config([ROOT / "configs/toy-cpu.yaml"], overrides))
    return sub.run, submit.submit(sub)


def wait_for_step(run, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (fsio.read_json(run.progress) or {}).get("step", 0) < step:
        status = get_status(run)
        assert status is None or status.state != "ABORTED", status
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s; logs: {runs.log_files(run)}"
        time.sleep(0.5)


@pytest.fixture
def easy_data(tiny_build) -> Path:
    return tiny_build.root / "data" / "easy"


def test_toy_runs_as_one_heterogeneous_job_and_both_components_complete(
    slurm_env, tmp_path, tiny_model_dir, easy_data, capsys
):
    args = [
        "submit",
        str(ROOT / "configs/toy-cpu.yaml"),
        *toy_overrides(tmp_path, tiny_model_dir, easy_data, "het", 2),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layout: hetjob" in out and "submitted Slurm job(s)" in out
    run = runs.find_run("toy-cpu/het", fileroot=str(tmp_path))
    (job_id,) = runs.job_ids(run)
    assert main(["logs", str(run.root), "--role", "controller", "-f"]) == 0  # returns once the run ends
    assert "controller: " in capsys.readouterr().out
    states = slurm.wait_final([job_id], timeout=60)
    assert states == {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}, runs.log_files(run)
    assert slurm.job(run.root / "slurm", job_id).state == "COMPLETED"  # submitit's Job sees the N+0 row
    assert [r["step"] for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r] == [1, 2]
    assert run.finished.exists()
    logs = {p.name for p in runs.log_files(run)}
    assert logs == {"controller.log", "gen_server0.log", "trainer0.log"}  # logs/attempt0/
    assert main(["status", "toy-cpu/het", "--fileroot", str(tmp_path)]) == 0
    status = capsys.readouterr().out
    assert f"slurm job {job_id}+1 (train): COMPLETED" in status and "run: COMPLETE" in status
    assert main(["list", "--fileroot", str(tmp_path)]) == 0
    assert f"COMPLETE  jobs {job_id}" in capsys.readouterr().out


def test_a_colocated_run_shares_the_trainers_gpu_with_its_server(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    """One plain job on the train partition; the server's step overlaps the trainer's GPU (srun --overlap): without
    sharing, the second step would wait for the GPU the first holds and no step would run."""
    colocated = ["allocation_mode=d1p1m1", "weight_update_mode=disk", "cluster.n_nodes=1"]
    run, (job_id,) = submit_toy(tmp_path, tiny_model_dir, easy_data, "colocated", 2, *colocated)
    assert slurm.wait_final([job_id], timeout=180) == {job_id: "COMPLETED"}, runs.log_files(run)
    steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("timeperf/release_memory" in r for r in steps)
    logs = {name: (run.attempt_logs(0) / f"{name}.log").read_text() for name in ("gen_server0", "trainer0")}
    assert all("CUDA_VISIBLE_DEVICES=0" in text for text in logs.values()), logs


def test_stop_cancels_every_component_within_10_seconds(slurm_env, tmp_path, tiny_model_dir, easy_data):
    run, (job_id,) = submit_toy(tmp_path, tiny_model_dir, easy_data, "stop", steps=1000)
    wait_for_step(run, 1)
    start = time.monotonic()
    states = runs.stop(run, timeout=10)
    assert time.monotonic() - start <= 10
    assert set(states.values()) == {"CANCELLED"}


def test_a_crashing_trainer_fails_the_whole_job_within_30_seconds(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    # Without recovery: a failed attempt ends the job (tests/test_slurm_requeue.py: the requeue).
    run, (job_id,) = submit_toy(tmp_path, tiny_model_dir, easy_data, "crash", 1000, "recover_mode=disabled")
    wait_for_step(run, 1)
    os.kill(role_pid(run, "trainer"), signal.SIGKILL)
    start = time.monotonic()
    states = slurm.wait_final([job_id], timeout=30)
    assert time.monotonic() - start <= 30
    assert set(states.values()) == {"FAILED"}, states
    err = next((run.root / "slurm").glob("*_0_log.err")).read_text()
    assert "step trainer ended" in err or "step controller ended" in err, err
    assert "recover_mode is disabled: the job is not requeued" in err


def test_asynchronous_toy_runs_its_rollout_role_in_the_training_component(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    run, (job_id,) = submit_toy(
        tmp_path, tiny_model_dir, easy_data, "async", 3, "async_rl=true", "max_head_offpolicyness=1"
    )
    states = slurm.wait_final([job_id], timeout=180)
    assert set(states.values()) == {"COMPLETED"}, (states, runs.log_files(run))
    assert {p.name for p in runs.log_files(run)} >= {"rollout.log", "controller.log"}
    steps = [r for r in read_stats(run.stats) if "ppo_actor/head_offpolicyness/max" in r]
    assert len(steps) == 3 and all(r["ppo_actor/head_offpolicyness/max"] <= 1 for r in steps)


def test_two_jobs_meet_through_the_run_directory_when_hetjobs_are_off(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    run, job_ids = submit_toy(tmp_path, tiny_model_dir, easy_data, "two", 2, "cluster.slurm.hetjob=false")
    assert len(job_ids) == 2
    states = slurm.wait_final(job_ids, timeout=180)
    assert set(states.values()) == {"COMPLETED"}, (states, runs.log_files(run))
    assert get_status(run).state == "COMPLETE"
    # A job sacct does not know (yet) is not over: waiting on it with an ended one times out.
    with pytest.raises(TimeoutError, match="still not ended"):
        slurm.wait_final([job_ids[0], "999999"], timeout=2)


def test_a_refused_submission_leaves_no_run_directory(slurm_env, tmp_path, tiny_model_dir, easy_data):
    with pytest.raises(slurm.SlurmError, match="sbatch failed"):
        submit_toy(tmp_path, tiny_model_dir, easy_data, "refused", 1, "cluster.slurm.train_partition=nope")
    assert not (tmp_path / getpass.getuser() / "toy-cpu" / "refused").exists()


def role_pid(run, role: str) -> int:
    """pid of a role process of `run`, found in /proc (the local cluster's nodes are this machine)."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "areal_hpc.launch.roles" in args and role in args and str(run.root) in args:
            return int(proc.name)
    raise LookupError(f"no {role} process of {run.root}")
