"""Stopping a local run from outside, as Ctrl-C stops it: SIGTERM or SIGHUP to `areal-hpc run`, or
`areal-hpc stop RUN`, leaves no process of the run, its agent programs included, even while they are busy."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.cli import main
from areal_hpc.control import RunDir, fsio, get_status
from areal_hpc.launch.processes import identity
from tests.helpers import REPO_ROOT, pids_with_arg

CONFIGS = [str(REPO_ROOT / "configs" / "toy-cpu.yaml")]


def program_arg(run_root: Path) -> str:
    """The argument of the run's agent programs: what finds them, and nothing else, in /proc."""
    return f"{run_root}#agent"


def start_busy_run(toy, trial: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`areal-hpc run` of the toy whose agent programs sleep, holding their episodes open; once they sleep."""
    run_root = toy.fileroot / os.environ.get("USER", "root") / "toy-cpu" / trial
    sleeper = shlex.join([sys.executable, "-c", "import time; time.sleep(600)", program_arg(run_root)])
    overrides = toy.overrides(trial, 1000, f"rollout.agent_command={sleeper}", *extra)
    # SIGHUP as a terminal would send it, even under `nohup make test`, whose ignored SIGHUP the launcher would
    # inherit and honour (it must: that is what nohup asks).
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc.cli", "run", *CONFIGS, *overrides], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(pids_with_arg(program_arg(run_root))) < 2:  # a group's episodes
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no agent program started within 120 s"
        time.sleep(0.2)
    return proc, run_root


def assert_nothing_left(run_root: Path, since: float, within: float = 10.0) -> None:
    while left := pids_with_arg(str(run_root), program_arg(run_root)):  # roles, agent programs
        assert time.monotonic() - since < within, f"still running after {within:g} s: {left}"
        time.sleep(0.2)


# The programs of asynchronous RL are the rollout role's, those of synchronous RL the controller's.
@pytest.mark.parametrize(
    ("sig", "mode", "code"),
    [(signal.SIGTERM, "async_rl=true", 143), (signal.SIGHUP, "async_rl=false", 129)],
    ids=["sigterm-rollout-role", "sighup-controller"],
)
def test_a_stop_signal_ends_every_role_and_agent_program(toy, sig, mode, code):
    proc, run_root = start_busy_run(toy, sig.name.lower(), mode)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code and f"stopped ({signal.Signals(sig).name})" in err, err
    assert_nothing_left(run_root, sent)
    assert get_status(RunDir(run_root)).state == "ABORTED"


def test_areal_hpc_stop_ends_a_local_run_within_seconds(toy, capsys):
    proc, run_root = start_busy_run(toy, "stopped", "async_rl=true")
    asked = time.monotonic()
    assert main(["stop", str(run_root)]) == 0
    assert time.monotonic() - asked < 10
    launcher = f"launcher {proc.pid} on {socket.gethostname()}"
    assert capsys.readouterr().out == f"{launcher}: stopped; the run is ABORTED\n"
    assert proc.wait(timeout=5) == 143
    assert_nothing_left(run_root, asked)


@pytest.mark.parametrize("record", ['{"pid": -1, "host": "h"}', '{"pid": "1"}', "[1]", "{not json"])
def test_areal_hpc_stop_refuses_a_launcher_record_it_cannot_trust(tmp_path, capsys, record):
    run = RunDir(tmp_path / "toy-cpu" / "odd")
    run.root.mkdir(parents=True)
    run.config.write_text("experiment_name: toy-cpu\n")
    run.launcher.write_text(record)
    assert main(["stop", str(run.root)]) != 0
    assert f"{run.launcher} is not a launcher's record" in capsys.readouterr().err


def test_areal_hpc_stop_leaves_alone_a_process_that_took_the_launchers_pid(tmp_path, capsys):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # The record of a launcher that had the bystander's pid before it: the same pid, started earlier.
        run = RunDir(tmp_path / "toy-cpu" / "reused")
        run.root.mkdir(parents=True)
        run.config.write_text("experiment_name: toy-cpu\n")
        bystander_was = identity(bystander.pid)
        fsio.write_json(run.launcher, bystander_was | {"start": bystander_was["start"] - 1})
        assert main(["stop", str(run.root)]) == 0
        assert "not running" in capsys.readouterr().out
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
