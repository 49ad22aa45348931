"""`areal-hpc run`: real processes (controller, generation server, two trainer ranks over gloo) end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import submitit

from areal_hpc import cli
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.rundir import RunDir, create_run_dir, run_dir_of
from areal_hpc.control.status import get_status
from areal_hpc.launch.local import run_local
from areal_hpc.launch.roles import role_main
from areal_hpc.monitor import read_timeline, step_rows, steps_of
from areal_hpc.monitor.stats import read_stats
from tests.helpers import role_pids, tensorboard_scalars

ROOT = Path(__file__).resolve().parents[1]
# Two trainer ranks and one server on three CPU slots.
TWO_TRAINERS = ("allocation_mode=builtin.d1p1m1+d2p1m1", "cluster.n_nodes=1", "cluster.n_gpus_per_node=3")


def test_three_synchronous_grpo_steps_with_two_trainer_ranks(toy, capsys):
    cfg = toy.config("t3", 3, *TWO_TRAINERS, "max_running_requests=6", "logging.profile_step=2")
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    assert get_status(run).state == "COMPLETE"
    steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    tensorboard = tensorboard_scalars(run.tensorboard)  # logging.tensorboard, on by default
    assert [step for step, _ in tensorboard["ppo_actor/task_reward/avg"]] == [1, 2, 3]
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in steps)  # reduced over both ranks
    assert all(r["ppo_actor/importance_weight/avg"] == pytest.approx(1.0, abs=1e-3) for r in steps)
    assert all(r["ppo_actor/head_offpolicyness/max"] == 0 for r in steps)  # synchronous: fresh weights
    records = list(Ledger(run.ledger).records())
    assert [len(r.ids) for r in records] == [4, 4, 4] and len({i for r in records for i in r.ids}) == 12
    assert (run.root / "checkpoints/actor/epoch0epochstep3globalstep3/model.safetensors").is_file()
    assert not list((run.root / "data").glob("step*"))  # each step's data dropped after the step
    out = capsys.readouterr().out
    assert "step 3/3" in out and "completed" in out
    server_log = (run.attempt_logs(0) / "gen_server0.log").read_text()
    counters = json.loads(server_log.split("engine counters: ", 1)[1].splitlines()[0])
    assert counters["max_batch_rows"] == 6  # max_running_requests: of 4 prompts x 2 answers, 2 wait
    # Where the time went (`areal-hpc trace`): a track per role and rank; the controller's parts of each step
    # (rollout, the model calls, the publication, ...) cover all of it but 5%.
    assert cli.main(["trace", str(run.root)]) == 0
    print(capsys.readouterr().out)
    trace = json.loads((run.logs / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"controller", "trainer0", "trainer1", "gen_server0"}
    events, skipped = read_timeline(run.timeline)
    rows = step_rows(events, steps_of(events))
    assert skipped == 0 and [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["other"] < 0.05 * r["wall"] for r in rows), rows
    assert all(r["actor_train"] > 0 and r["idle trainer"] < 1 and r["idle gen_server"] < 1 for r in rows)
    # A trainer's own phases: each minibatch's forward and backward and optimizer step, and once a run the
    # page-locking of its recover checkpoint's buffers (seconds at 1.5B, inside step 1's train_step).
    trainer0 = Counter(e.name for e in events if e.task == "trainer0")
    assert trainer0["forward_backward"] == trainer0["optimizer"] >= 3 and trainer0["checkpoint_buffers"] == 1
    # Step 2's trainer calls under torch.profiler, joined to the trace on its clock.
    profiles = sorted(p.name for p in run.timeline.glob("profile.*.json"))
    assert profiles == [
        f"profile.{mfc}.step2.trainer{r}.json" for mfc in ("actor_inf", "actor_train") for r in (0, 1)
    ]
    assert (
        cli.main(["trace", str(run.root), "--steps", "2", "--cuda", "--out", str(run.root / "t2.json")]) == 0
    )
    trace = json.loads((run.root / "t2.json").read_text())["traceEvents"]
    step2 = next(e for e in trace if e["name"] == "step")
    matmuls = [e for e in trace if e["name"] == "aten::mm"]
    assert matmuls and all(step2["ts"] <= e["ts"] <= step2["ts"] + step2["dur"] for e in matmuls)


def start_run(toy, trial: str, *extra: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, Path]:
    overrides = toy.overrides(trial, 1000, *TWO_TRAINERS, *extra)
    cmd = [sys.executable, "-m", "areal_hpc.cli", "run", str(ROOT / "configs/toy-cpu.yaml"), *overrides]
    # A shell's background job starts with SIGINT ignored.
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    run_root = toy.fileroot / os.environ.get("USER", "root") / "toy-cpu" / trial
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


@pytest.mark.parametrize("victim", ["trainer1", "gen_server0", "controller"])
def test_killing_a_role_mid_run_stops_every_role_with_a_clear_error(toy, victim):
    # Without recovery: recovery's restarts are tests/test_recover_local.py's.
    proc, run_root = start_run(toy, f"kill-{victim.replace('_', '-')}", "recover_mode=disabled")
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
    assert get_status(RunDir(run_root)).state == "ABORTED"


def test_roles_stop_when_the_launcher_is_killed_outright(toy):
    proc, run_root = start_run(toy, "launcher-killed")
    wait_for_step(run_root, proc, 1)
    proc.kill()  # SIGKILL: the launcher cannot stop its roles itself
    proc.communicate()
    deadline = time.monotonic() + 15
    while role_pids(run_root):
        assert time.monotonic() < deadline, f"roles still running: {role_pids(run_root)}"
        time.sleep(0.2)


def test_ctrl_c_stops_every_role_even_when_started_with_sigint_ignored(toy):
    proc, run_root = start_run(toy, "ctrl-c", sigint_ignored=True)
    wait_for_step(run_root, proc, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert role_pids(run_root) == {}
    assert get_status(RunDir(run_root)).state == "ABORTED"


def test_submitit_local_executor_starts_the_same_entry_point(toy, tmp_path):
    """Each role as a submitit LocalExecutor job: two trainer tasks learn ranks 0 and 1 from the job."""
    cfg = toy.config("submitit", 2, *TWO_TRAINERS)
    run = create_run_dir(cfg)

    def submit(role: str, tasks: int):
        executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
        executor.update_parameters(tasks_per_node=tasks, timeout_min=5)
        return executor.submit(role_main, run.root, role)

    jobs = [submit("gen_server", 1), submit("trainer", 2), submit("controller", 1)]
    assert [job.results() for job in jobs] == [[0], [0, 0], [0]]
    assert get_status(run).state == "COMPLETE"
    assert [r["step"] for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r] == [1, 2]
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in read_stats(run.stats) if "ppo_actor/n_seqs" in r)


def test_a_failure_every_attempt_would_repeat_ends_the_run_at_once(toy, capsys):
    # Every prompt is longer than max_prompt_len: the controller finds no prompt to train on. A restart would
    # fail alike, so none is made, whatever recover_retries says.
    cfg = toy.config("too-long", 2, "dataset.max_prompt_len=8", "recover_mode=auto", "recover_retries=2")
    assert run_local(cfg) == 1
    err = capsys.readouterr().err
    assert "0 of the 250 prompts" in err and "dataset.max_prompt_len=8" in err and "not restarted" in err
    run = run_dir_of(cfg)
    assert get_status(run).permanent and not run.attempt_logs(1).exists()


def test_grpo_steps_with_the_actor_trained_on_two_pipeline_stages_and_recomputed_on_a_tp2_copy(toy):
    layouts = "allocation_mode=builtin.d1p1m1+actor_train:d1p2m1,actor_inf:d1p1m2"
    cfg = toy.config("megatron-pp2", 2, layouts, "cluster.n_nodes=1", "cluster.n_gpus_per_node=3",
                     "actor.backend=megatron", "param_realloc_mode=disk", "recover_mode=disabled")  # fmt: skip
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # One data-parallel replica of two stages: its samples counted once; its losses are the last stage's.
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in steps)
    # The copy's proximal logprobs are the trained weights': it moved to them after step 1.
    assert "timeperf/param_realloc" in steps[1] and "timeperf/param_realloc" not in steps[0]
    assert all(r["ppo_actor/importance_weight/avg"] == pytest.approx(1.0, abs=1e-3) for r in steps)
    assert (run.root / "checkpoints/actor/epoch0epochstep2globalstep2/model.safetensors").is_file()
