"""A role process: its place comes from the job environment and must match the plan; a server gives up on a run
that is over."""

import os
import time

import pytest

from areal_hpc.control import (
    EXIT_PERMANENT,
    START_TIMEOUT_SECS,
    Heartbeat,
    RunDir,
    abort,
    complete,
    create_run_dir,
    get_status,
    why_stop,
)
from areal_hpc.control.heartbeat import heartbeat_path
from areal_hpc.launch.roles import JobEnvironmentError, role_main, run_context, task_of_job


def test_the_index_comes_from_the_job_environment(monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert task_of_job() == (3, 4, False)  # not local: servers listen on every interface


def test_a_role_outside_any_job_says_how_to_start_it(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with pytest.raises(JobEnvironmentError, match="areal-hpc run"):
        task_of_job()


def test_a_server_serves_while_the_controller_beats_and_stops_when_the_run_finished(tmp_path):
    run = RunDir(tmp_path)
    assert why_stop(run, waited=1.0) is None  # the controller may still be starting
    with Heartbeat(run.heartbeats, "controller"):
        assert why_stop(run, waited=10 * START_TIMEOUT_SECS) is None
        complete(run, "controller")
        assert why_stop(run, waited=1.0) == ""  # finished: a clean stop


def test_a_server_gives_up_on_a_run_that_failed_or_whose_controller_vanished(tmp_path):
    run = RunDir(tmp_path)
    assert "no controller started" in why_stop(run, waited=START_TIMEOUT_SECS + 1)
    Heartbeat(run.heartbeats, "controller").beat("alive")  # alive, then silent: as if killed -9
    old = time.time() - 120
    os.utime(heartbeat_path(run.heartbeats, "controller"), (old, old))
    assert "last heartbeat is 120 s old" in why_stop(run, waited=1.0, dead_secs=60)
    abort(run, "OOM in trainer1", "trainer1")
    assert why_stop(run, waited=1.0) == "the run was aborted by trainer1: OOM in trainer1"


def test_a_task_count_other_than_the_plan_is_refused_and_not_retried(toy, monkeypatch):
    run = create_run_dir(toy.config("count", 1))  # one trainer rank
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(JobEnvironmentError, match="the job started 2 trainer task"):
        run_context(run, "trainer")
    assert role_main(run.root, "trainer") == EXIT_PERMANENT
    status = get_status(run)
    assert status.state == "ABORTED" and status.permanent and "plans 1" in status.reason
