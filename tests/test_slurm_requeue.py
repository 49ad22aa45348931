"""Recovery inside Slurm on the real local cluster: a failed attempt requeues its job, retries run out, and
`areal-hpc submit --recover` submits a stopped run again (or refuses to)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control import fsio
from areal_hpc.control.rundir import RunDir, create_run_dir
from areal_hpc.control.status import get_status
from areal_hpc.launch import runs, slurm
from areal_hpc.launch.plan import launch_plan
from areal_hpc.recover.checkpoint import Checkpoints
from tests.slurm import job_log, role_env, start_requeued, submit, wait_role
from tests.test_slurm_submit import ROOT, submit_toy, toy_overrides, wait_for_step

pytestmark = pytest.mark.slurm
RECOVER = ("recover_mode=auto", "recover_retries=1", "recover_after=1")


@pytest.fixture
def easy_data(tiny_build) -> Path:
    return tiny_build.root / "data" / "easy"


def test_a_killed_trainer_requeues_the_hetjob_and_the_next_attempt_resumes(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    # 8 steps: the kill must land before the run ends (3 toy steps took 9 s with the kill late).
    run, (job_id,) = submit_toy(
        tmp_path, tiny_model_dir, easy_data, "requeue", 8, *RECOVER, "exp_ctrl.ckpt_freq_steps=1"
    )
    deadline = time.monotonic() + 90
    while Checkpoints(run.recover).latest() is None:  # a step trained and checkpointed
        assert time.monotonic() < deadline, runs.log_files(run)
        time.sleep(0.2)
    os.kill(wait_role(run, "trainer", 0), signal.SIGKILL)

    start_requeued(slurm_env, job_id)  # the same job, both components
    trainer = role_env(wait_role(run, "trainer", 1))
    assert trainer["SLURM_RESTART_COUNT"] == "1"
    assert "attempt 0 failed; requeueing job" in job_log(run, "err")
    out = job_log(run, "out")
    assert "AREAL_ATTEMPT=0 (Slurm restart 0)" in out and "AREAL_ATTEMPT=1 (Slurm restart 1)" in out

    states = slurm.wait_final([job_id], timeout=90)
    assert set(states.values()) == {"COMPLETED"}, (states, runs.log_files(run))
    history = slurm_env.run("sacct", "-j", job_id, "-D", "-X", "-n", "-P", "-o", "JobID,State").stdout
    assert "|REQUEUED" in history and "FAILED" not in history, history  # the first run is not a failure
    assert sorted(p.name for p in run.logs.glob("attempt*")) == ["attempt0", "attempt1"]
    # The resume itself (controller, recover/): attempt 1 started from the checkpoint of a step, not afresh.
    start = fsio.read_json(run.start_point)
    assert start["attempt"] == 1 and start["global_step"] >= 1, start
    assert get_status(run).state == "COMPLETE" and fsio.read_json(run.progress)["step"] == 8


def test_scontrol_requeue_checkpoints_on_sigterm_and_the_requeued_run_resumes_there(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    # Slurm's requeue sends SIGTERM to every task and SIGKILL KillWait (5 s) later. No periodic checkpoints:
    # the controller writes the only one on SIGTERM, while the trainer serves on for it.
    run, (job_id,) = submit_toy(
        tmp_path, tiny_model_dir, easy_data, "term", 8, *RECOVER, "exp_ctrl.ckpt_freq_steps=null"
    )
    wait_for_step(run, 2)
    slurm_env.run("scontrol", "requeue", job_id)
    states = slurm.wait_final([job_id], timeout=180)
    assert set(states.values()) == {"COMPLETED"}, (states, runs.log_files(run))
    log = (run.attempt_logs(0) / "controller.log").read_text()
    assert "SIGTERM: writing a recover checkpoint" in log and "Dumped recover info to file." in log, log
    start = fsio.read_json(run.start_point)
    assert start["attempt"] == 1 and start["global_step"] >= 2, start
    assert not (run.logs / "failed_attempts").exists()  # Slurm's requeue is no failure
    assert get_status(run).state == "COMPLETE" and fsio.read_json(run.progress)["step"] == 8


def test_a_job_whose_retries_are_used_up_fails_without_another_attempt(
    slurm_env, tmp_path, tiny_model_dir, easy_data
):
    run, (job_id,) = submit_toy(tmp_path, tiny_model_dir, easy_data, "used-up", 1000, *RECOVER)
    os.kill(wait_role(run, "trainer", 0), signal.SIGKILL)
    start_requeued(slurm_env, job_id)
    os.kill(wait_role(run, "trainer", 1), signal.SIGKILL)
    states = slurm.wait_final([job_id], timeout=30)
    assert set(states.values()) == {"FAILED"}, states
    assert "recover_retries (1) are used up (1 failed attempts)" in job_log(run, "err")
    assert not run.attempt_logs(2).exists()


def test_a_failure_every_attempt_would_repeat_is_not_requeued(slurm_env, tmp_path, tiny_model_dir, easy_data):
    # Every prompt is longer than max_prompt_len: the controller finds none to train on, on any attempt.
    run, (job_id,) = submit_toy(
        tmp_path, tiny_model_dir, easy_data, "too-long", 2, *RECOVER, "dataset.max_prompt_len=8"
    )
    states = slurm.wait_final([job_id], timeout=180)
    assert set(states.values()) == {"FAILED"}, states
    assert "failed in a way a new attempt would repeat" in job_log(run, "err")
    status = get_status(run)
    assert status.permanent and "dataset.max_prompt_len=8" in status.reason
    assert not run.attempt_logs(1).exists() and not run.failed_attempts.exists()


def made_run(tmp_path: Path, tiny_model_dir: Path, data: Path, trial: str, *extra: str) -> RunDir:
    """A run directory as `areal-hpc submit` makes it, with no Slurm job recorded yet."""
    cfg = load_config(
        [ROOT / "configs/toy-cpu.yaml"], [*toy_overrides(tmp_path, tiny_model_dir, data, trial, 2), *extra]
    )
    run = create_run_dir(cfg)
    run.slurm.mkdir()
    fsio.write_json(run.jobs, {"kind": launch_plan(cfg, run).kind, "workdir": str(ROOT), "jobs": []})
    return run


def test_submit_recover_takes_a_job_slurm_forgot_as_ended_and_a_held_one_as_live(
    slurm_env, tmp_path, tiny_model_dir, easy_data, capsys
):
    run = made_run(tmp_path, tiny_model_dir, easy_data, "forgot", "recover_mode=auto")
    held = submit(slurm_env, "--hold", "-o", "/dev/null", "--wrap", "true")
    try:
        for job_id, live in (("99999999", False), (held, True)):  # never known (or purged long ago); pending
            fsio.write_json(
                run.jobs, {**fsio.read_json(run.jobs), "jobs": [{"job_id": job_id, "components": []}]}
            )
            code = main(["submit", "--recover", str(run.root), "--dry-run"])
            err = capsys.readouterr().err
            assert (code, f"its Slurm job {job_id} has not ended" in err) == (
                (2, True) if live else (0, False)
            ), err
    finally:
        slurm_env.run("scancel", held, check=False)


def test_submit_recover_refuses_a_finished_run(tmp_path, tiny_model_dir, easy_data, capsys):
    run = made_run(tmp_path, tiny_model_dir, easy_data, "done")
    run.finished.touch()
    assert main(["submit", "--recover", "toy-cpu/done", "--fileroot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot recover {run.root}: it finished (FINISHED exists)" in err


@pytest.mark.parametrize(
    "mode, why",
    [("disabled", "recover_mode is disabled"), ("resume", "recover_mode is resume but")],
)
def test_submit_recover_refuses_a_run_that_cannot_resume(
    tmp_path, tiny_model_dir, easy_data, capsys, mode, why
):
    run = made_run(tmp_path, tiny_model_dir, easy_data, mode, f"recover_mode={mode}")
    assert main(["submit", "--recover", str(run.root)]) == 2
    assert f"cannot recover {run.root}: {why}" in capsys.readouterr().err
    assert not (run.root / "slurm" / f"toy-cpu_{mode}.sh").exists()  # nothing submitted


def test_submit_recover_refuses_a_live_job_then_resubmits_the_stopped_run(
    slurm_env, tmp_path, tiny_model_dir, easy_data, capsys
):
    run, (first,) = submit_toy(tmp_path, tiny_model_dir, easy_data, "live", 1000, *RECOVER)
    assert main(["submit", "--recover", str(run.root)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"cannot recover {run.root}: its Slurm job {first}(\+0)? has not ended \(", err), err
    runs.stop(run, timeout=30)

    assert main(["submit", "--recover", str(run.root), "--dry-run"]) == 0
    # Attempt 0, or 1 if the first job began attempt 0 before it was stopped.
    attempt = int(re.search(r"recover: attempt (\d+)", capsys.readouterr().out).group(1))
    assert main(["submit", "--recover", str(run.root)]) == 0
    assert "resubmitted Slurm job(s)" in capsys.readouterr().out
    (second,) = runs.job_ids(run)  # status and stop see the newest job; jobs.json keeps both
    assert second != first
    assert [j["job_id"] for j in runs.recorded_jobs(run)] == [first, second]
    wait_role(run, "controller", attempt)
    states = runs.stop(run, timeout=30)  # sacct may show a young hetjob as N, not N+0 and N+1
    assert {component.split("+")[0] for component in states} == {second}


def test_a_two_job_run_is_recovered_by_the_submitting_host_beginning_the_attempt(
    slurm_env, tmp_path, tiny_model_dir, easy_data, capsys
):
    run = made_run(tmp_path, tiny_model_dir, easy_data, "two", "cluster.slurm.hetjob=false")
    run.attempt_logs(0).mkdir()  # an earlier attempt
    assert main(["submit", "--recover", str(run.root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "recover: attempt 1" in out and out.count("\nattempt=1\n") == 2
    assert "areal_hpc.recover.attempt" not in out
    assert main(["submit", "--recover", str(run.root)]) == 0
    assert run.attempt_logs(1).is_dir()  # begun here, before either job started
    for job_id in runs.job_ids(run):  # one job requeued alone would strand the other
        refused = slurm_env.run("scontrol", "requeue", job_id, check=False)
        assert refused.returncode != 0 and "disabled" in refused.stderr, refused
    wait_role(run, "controller", 1)  # the training job runs attempt 1 (AREAL_ATTEMPT=1) without beginning one
    assert not run.attempt_logs(2).exists()
    assert len(runs.stop(run, timeout=30)) == 2
