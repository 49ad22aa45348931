"""`areal-hpc run`: real processes (controller, generation server, two trainer ranks over gloo) end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit

from areal_hpc.config import load_config
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.status import get_status
from areal_hpc.launch.local import run_local
from areal_hpc.launch.roles import role_main
from areal_hpc.launch.rundir import create_run_dir, run_dir_of
from areal_hpc.monitor.stats import read_stats

ROOT = Path(__file__).resolve().parents[1]


def toy_overrides(tmp_path: Path, model_dir: Path, data: Path, trial: str, steps: int) -> list[str]:
    """Two trainer ranks and one server on three CPU slots; tiny batches so a step takes a second."""
    return [
        f"cluster.fileroot={tmp_path}",
        f"trial_name={trial}",
        f"actor.path={model_dir}",
        f"dataset.path={data / 'train.jsonl'}",
        f"dataset.valid_path={data / 'test.jsonl'}",
        "allocation_mode=sglang.d1p1m1+d2p1m1",
        "cluster.n_nodes=1",
        "cluster.n_gpus_per_node=3",
        "dataset.train_bs_n_seqs=4",
        "group_size=2",
        "ppo.gen.max_new_tokens=6",
        f"exp_ctrl.benchmark_steps={steps}",
    ]


@pytest.fixture
def easy_data(tiny_build) -> Path:
    return tiny_build.root / "data" / "easy"


def test_three_synchronous_grpo_steps_with_two_trainer_ranks(tmp_path, tiny_model_dir, easy_data, capsys):
    cfg = load_config(
        [ROOT / "configs/toy-cpu.yaml"], toy_overrides(tmp_path, tiny_model_dir, easy_data, "t3", 3)
    )
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    assert get_status(run.root).state == "COMPLETE"
    steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in steps)  # reduced over both ranks
    assert all(r["ppo_actor/importance_weight/avg"] == pytest.approx(1.0, abs=1e-3) for r in steps)
    assert all(r["ppo_actor/head_offpolicyness/max"] == 0 for r in steps)  # synchronous: fresh weights
    records = list(Ledger(run.root).records())
    assert [len(r.ids) for r in records] == [4, 4, 4] and len({i for r in records for i in r.ids}) == 12
    assert (run.root / "checkpoints/actor/epoch0epochstep3globalstep3/model.safetensors").is_file()
    assert not list((run.root / "data").glob("step*"))  # each step's data dropped after the step
    out = capsys.readouterr().out
    assert "step 3/3" in out and "completed" in out


def start_run(tmp_path, tiny_model_dir, easy_data, trial: str) -> tuple[subprocess.Popen, Path]:
    overrides = toy_overrides(tmp_path, tiny_model_dir, easy_data, trial, 1000)
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(ROOT / "configs/toy-cpu.yaml"), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_root = tmp_path / os.environ.get("USER", "root") / "toy-cpu" / trial
    return proc, run_root


def wait_for_step(run_root: Path, proc: subprocess.Popen, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = run_root / "progress.json"
        if progress.is_file() and json.loads(progress.read_text() or "{}").get("step", 0) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def role_pids(run_root: Path) -> dict[str, int]:
    """pid of each role process of a run, from /proc."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv if a]
        if "areal_hpc.launch.roles" in args and str(run_root) in args:
            role = next(a for a in args if a in ("controller", "gen_server", "trainer"))
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
            index = "" if role == "controller" else env[b"SUBMITIT_LOCAL_GLOBALID"].decode()
            pids[role + index] = int(proc.name)
    return pids


@pytest.mark.parametrize("victim", ["trainer1", "gen_server0", "controller"])
def test_killing_a_role_mid_run_stops_every_role_with_a_clear_error(
    tmp_path, tiny_model_dir, easy_data, victim
):
    proc, run_root = start_run(tmp_path, tiny_model_dir, easy_data, f"kill-{victim.replace('_', '-')}")
    wait_for_step(run_root, proc, 1)
    pids = role_pids(run_root)
    assert set(pids) == {"controller", "gen_server0", "trainer0", "trainer1"}
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - killed <= 10, "the run took more than 10 s to stop"
    assert proc.returncode == 1
    assert victim in err and ("exit code -9" in err or "aborted the run" in err), err
    assert role_pids(run_root) == {}
    assert get_status(run_root).state == "ABORTED"


def test_ctrl_c_stops_every_role(tmp_path, tiny_model_dir, easy_data):
    proc, run_root = start_run(tmp_path, tiny_model_dir, easy_data, "ctrl-c")
    wait_for_step(run_root, proc, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert role_pids(run_root) == {}
    assert get_status(run_root).state == "ABORTED"


def test_submitit_local_executor_starts_the_same_entry_point(tmp_path, tiny_model_dir, easy_data):
    """Each role as a submitit LocalExecutor job: two trainer tasks learn ranks 0 and 1 from the job."""
    cfg = load_config(
        [ROOT / "configs/toy-cpu.yaml"], toy_overrides(tmp_path, tiny_model_dir, easy_data, "submitit", 2)
    )
    run = create_run_dir(cfg)

    def submit(role: str, tasks: int):
        executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
        executor.update_parameters(tasks_per_node=tasks, timeout_min=5)
        return executor.submit(role_main, run.root, role)

    jobs = [submit("gen_server", 1), submit("trainer", 2), submit("controller", 1)]
    assert [job.results() for job in jobs] == [[0], [0, 0], [0]]
    assert get_status(run.root).state == "COMPLETE"
    assert [r["step"] for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r] == [1, 2]
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r)
