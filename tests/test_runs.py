"""`areal-hpc status | logs | list` find runs by directory, by experiment/trial, or by the run's own config,
whose cluster.fileroot they search (a relative one from the working directory, as `areal-hpc run` made it);
without one, under the default fileroot and the shipped configs' (the toys' runs/)."""

from __future__ import annotations

from areal_hpc.cli import main
from areal_hpc.control import create_run_dir
from areal_hpc.launch import slurm
from areal_hpc.monitor import progress_line
from tests.helpers import REPO_ROOT

TOY = str(REPO_ROOT / "configs" / "toy-cpu.yaml")


def test_a_config_names_its_runs_under_its_own_fileroot(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first = create_run_dir(toy.config("first", 1, "cluster.fileroot=runs"))
    second = create_run_dir(toy.config("second", 1, "cluster.fileroot=runs"))
    assert main(["list", TOY]) == 0  # toy-cpu.yaml says fileroot: runs
    assert capsys.readouterr().out.splitlines() == [
        f"{first.root}  NOT STARTED  jobs local",
        f"{second.root}  NOT STARTED  jobs local",
    ]
    assert main(["status", TOY]) == 0  # the newest run of the experiment
    assert capsys.readouterr().out.startswith(f"run {second.root}\n")
    assert main(["status", TOY, "trial_name=first"]) == 0
    assert capsys.readouterr().out.startswith(f"run {first.root}\n")
    assert main(["logs", "toy-cpu/first", "--fileroot", "runs"]) == 1
    assert f"no role logs yet in {first.logs}" in capsys.readouterr().err


def test_without_a_config_runs_are_found_where_shipped_configs_put_them(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # nothing under ~/areal_hpc
    assert main(["list"]) == 0
    looked = capsys.readouterr().out
    assert looked.startswith(f"no runs under {tmp_path}/home/areal_hpc/") and f"{tmp_path}/runs/" in looked
    run = create_run_dir(toy.config("mine", 1, "cluster.fileroot=runs"))  # toy-cpu.yaml's fileroot
    assert main(["list"]) == 0
    assert capsys.readouterr().out == f"{run.root}  NOT STARTED  jobs local\n"
    assert main(["status"]) == 0
    assert capsys.readouterr().out.startswith(f"run {run.root}\n")
    assert main(["stop", "toy-cpu/mine"]) == 1
    assert f"{run.root} has no Slurm jobs, and no `areal-hpc run` runs it" in capsys.readouterr().err


def test_a_run_that_is_not_there_is_named(toy, tmp_path, capsys):
    assert main(["logs", TOY, f"cluster.fileroot={tmp_path}"]) == 1
    assert "areal-hpc logs: no run of" in capsys.readouterr().err
    assert main(["stop", "toy-cpu/none", "--fileroot", str(tmp_path)]) == 1
    assert "no run 'toy-cpu/none'" in capsys.readouterr().err


def test_the_progress_line_says_what_its_number_is():
    rl = {"step": 3, "total_steps": 6, "metric": "reward", "value": 0.25, "eta_secs": 61, "time": 0}
    assert progress_line(rl).endswith("step 3/6 reward 0.250 ETA 0:01:01")
    sft = {**rl, "metric": "loss", "value": 6.93}
    assert "step 3/6 loss 6.930" in progress_line(sft)  # a supervised warm-up has no reward


def test_a_heterogeneous_job_pending_beside_a_failed_component_is_stuck():
    assert slurm.stuck({"8+0": "PENDING", "8+1": "FAILED"})  # after its leader's node failed (Slurm 22.05)
    assert not slurm.stuck({"8+0": "PENDING", "8+1": "PENDING"})  # requeued whole, or not started yet
    assert not slurm.stuck({"8+0": "RUNNING", "8+1": "RUNNING"}) and not slurm.stuck({"8": "PENDING"})
