"""A role process: its index comes from the job environment; a server gives up on a run that is over."""

import os
import time

import pytest

from areal_hpc.control.heartbeat import Heartbeat, heartbeat_path
from areal_hpc.control.rundir import RunDir
from areal_hpc.control.status import abort, complete
from areal_hpc.launch.roles import START_TIMEOUT_SECS, JobEnvironmentError, task_of_job, why_stop


def test_the_index_comes_from_the_job_environment(monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert task_of_job() == (3, 4)


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
