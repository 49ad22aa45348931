"""`areal-hpc status` of a run in progress, once or live: its roles, step, reward and ETA, rollouts in flight
and staleness, its checkpoints, all read from the run directory."""

from __future__ import annotations

import io
import threading
import time

from rich.console import Console

from areal_hpc.cli import main
from areal_hpc.config import load_config
from areal_hpc.control import COMPLETE, RUNNING, Heartbeat, fsio, set_status
from areal_hpc.control.rundir import create_run_dir
from areal_hpc.gen.manager import GenerationManager, ManagerState
from areal_hpc.launch.run_status import roles_line, status_rows, watch
from areal_hpc.monitor import StatsLog, write_progress


def a_run_at_step_3(tmp_path):
    """A run directory as an asynchronous run leaves it after 3 of 10 steps, 2 rollouts in flight."""
    run = create_run_dir(load_config(overrides=[f"cluster.fileroot={tmp_path}", "trial_name=t1"]))
    set_status(run, RUNNING, role="controller")
    write_progress(run.progress, 3, 10, "reward", 0.25, eta_secs=70)
    manager = GenerationManager(1, 4, 2, 8, state=ManagerState(version=3, accepted=14, dropped=1))
    assert manager.allocate_rollout() and manager.allocate_rollout()
    fsio.write_json(run.generation, {**manager.counters(), "waiting_samples": 5})
    StatsLog(run.stats).write(
        3, {"ppo_actor/head_offpolicyness/avg": 0.5, "ppo_actor/head_offpolicyness/max": 2}
    )
    return run


def test_status_shows_rollouts_in_flight_and_how_stale_they_may_be(tmp_path):
    run = a_run_at_step_3(tmp_path)
    with Heartbeat(run.heartbeats, "controller"), Heartbeat(run.heartbeats, "trainer0"):
        shown = dict(status_rows(run))
    assert shown["run"] == "RUNNING"
    assert shown["roles"] == "2 of 2 alive"
    assert shown["progress"].endswith("step 3/10 reward 0.250 ETA 0:01:10")
    assert shown["rollouts in flight"] == (
        "2 (at most 8); 14 accepted, 1 dropped; 5 samples waiting for a server slot"
    )
    assert shown["staleness"] == (
        "servers hold weight version 3; new rollouts aim at version 4 (bound 5); "
        "last step's samples 0.5 versions behind (max 2)"
    )
    assert shown["recover checkpoint"] == shown["saved checkpoint"] == "none yet"


def test_a_role_that_stopped_beating_is_named(tmp_path):
    run = a_run_at_step_3(tmp_path)
    with Heartbeat(run.heartbeats, "controller"), Heartbeat(run.heartbeats, "trainer0"):
        assert roles_line(run) == "2 of 2 alive"
        assert roles_line(run, now=time.time() + 45) == "0 of 2 alive; silent: controller 45 s, trainer0 45 s"
    assert roles_line(run) == "0 of 2 alive; stopped: controller, trainer0"  # they ended cleanly


def test_watch_redraws_until_the_run_ends(tmp_path):
    run = a_run_at_step_3(tmp_path)
    out = io.StringIO()

    def finish_later():
        time.sleep(0.3)
        write_progress(run.progress, 10, 10, "reward", 0.75, eta_secs=0)
        set_status(run, COMPLETE, role="controller", reason="finished")

    threading.Thread(target=finish_later).start()
    watch(run, interval=0.05, console=Console(file=out, width=200))
    assert "COMPLETE (controller: finished)" in out.getvalue() and "step 10/10 reward 0.750" in out.getvalue()


def test_areal_hpc_status_prints_the_rows(tmp_path, capsys):
    run = a_run_at_step_3(tmp_path)
    assert main(["status", str(run.root)]) == 0
    assert (
        "  rollouts in flight: 2 (at most 8); 14 accepted, 1 dropped; 5 samples waiting"
        in capsys.readouterr().out
    )
