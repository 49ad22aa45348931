"""A real Slurm cluster on loopback (tools/slurm_local): what tests can ask of it, as examples.

Nodes n1-n4 (4 CPUs, gpu:2 each); partitions gen = n[1-2] (default), train = n[3-4], all, urgent.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.slurm import CLUSTER_PY, submit, wait_for_job

pytestmark = pytest.mark.slurm


def test_sbatch_wrap_completes_and_sacct_records_it(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = submit(
        slurm_cluster, f"--chdir={tmp_path}", f"--output={out}", "--wrap", "echo hello from $SLURMD_NODENAME"
    )
    assert wait_for_job(slurm_cluster, job) == {job: "COMPLETED"}
    assert out.read_text().strip() in {"hello from n1", "hello from n2"}  # gen, the default partition


def test_srun_step_spans_two_nodes(slurm_cluster):
    result = slurm_cluster.run("srun", "-N2", "-p", "all", "bash", "-c", "echo $SLURMD_NODENAME")
    assert len(set(result.stdout.split())) == 2


def test_gpus_per_node_sets_cuda_visible_devices(slurm_cluster):
    result = slurm_cluster.run(
        "srun", "-p", "gen", "--gpus-per-node=2", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"
    )
    assert result.stdout.strip() == "0,1"


HETJOB = """#!/bin/bash
#SBATCH --partition=gen --nodes=1 --ntasks=1 --output={out}
#SBATCH hetjob
#SBATCH --partition=train --nodes=1 --ntasks=1
echo $SLURM_JOB_NODELIST_HET_GROUP_0 $SLURM_JOB_NODELIST_HET_GROUP_1
srun --het-group=0,1 bash -c 'echo step on $SLURMD_NODENAME'
"""


def test_hetjob_runs_one_component_per_partition(slurm_cluster, tmp_path):
    script = tmp_path / "het.sh"
    out = tmp_path / "het.out"
    script.write_text(HETJOB.format(out=out))
    job = submit(slurm_cluster, f"--chdir={tmp_path}", str(script))
    states = wait_for_job(slurm_cluster, job, rows=(f"{job}+0", f"{job}+1"))
    assert states == {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}
    groups, *steps = out.read_text().splitlines()
    gen_node, train_node = groups.split()
    assert gen_node in {"n1", "n2"} and train_node in {"n3", "n4"}
    assert sorted(steps) == sorted([f"step on {gen_node}", f"step on {train_node}"])


def test_up_refuses_a_running_cluster(slurm_cluster):
    up = [sys.executable, str(CLUSTER_PY), "up", "--root", str(slurm_cluster.root)]
    result = subprocess.run(up, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "already running" in result.stderr
    assert slurm_cluster.run("sinfo", "-h").returncode == 0  # and it left the cluster alone
