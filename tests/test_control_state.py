"""Heartbeats and dead workers, experiment status finality, the ledger of consumed ids."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import pytest

from areal_hpc.control import (
    ABORTED,
    COMPLETE,
    RUNNING,
    Heartbeat,
    Ledger,
    RunDir,
    abort,
    complete,
    dead_workers,
    get_status,
    last_beat,
    set_status,
)
from areal_hpc.control.status import StatusError

SPAWN = multiprocessing.get_context("spawn")

# heartbeats


def _beat_forever(run_dir: str) -> None:
    Heartbeat(run_dir, "victim", interval=0.05).start()
    while True:
        time.sleep(1)


def test_a_killed_worker_is_reported_dead_after_the_timeout(tmp_path):
    child = SPAWN.Process(target=_beat_forever, args=(str(tmp_path),))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while last_beat(tmp_path, "victim") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # several beats later it is still alive
        assert dead_workers(tmp_path, ["victim"], timeout=1.5) == []
        assert last_beat(tmp_path, "victim")["pid"] == child.pid
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    assert dead_workers(tmp_path, ["victim"], timeout=1.5) == []  # not yet: within the timeout
    time.sleep(1.7)
    assert dead_workers(tmp_path, ["victim"], timeout=1.5) == ["victim"]


def test_never_beating_is_dead_and_a_clean_stop_is_not(tmp_path):
    with Heartbeat(tmp_path, "clean", interval=0.05):
        time.sleep(0.12)
        beat = last_beat(tmp_path, "clean")
        assert beat["state"] == "alive" and beat["pid"] == os.getpid()
        assert time.time() - beat["time"] < 5
    time.sleep(0.2)
    assert dead_workers(tmp_path, ["clean", "ghost"], timeout=0.1) == ["ghost"]
    assert last_beat(tmp_path, "clean")["state"] == "stopped"


def test_a_beat_rewrites_a_heartbeat_file_removed_under_it(tmp_path):
    beat = Heartbeat(tmp_path, "w", interval=10).start()
    beat.path.unlink()
    beat.beat()
    assert last_beat(tmp_path, "w")["state"] == "alive"
    beat.stop()
    assert dead_workers(tmp_path, ["w"], timeout=0) == []


def test_heartbeat_names_are_checked(tmp_path):
    with pytest.raises(ValueError, match="heartbeat name"):
        Heartbeat(tmp_path, "../up")


# status


def test_status_is_final_once_complete_or_aborted(tmp_path):
    run = RunDir(tmp_path)
    assert get_status(run) is None
    running = set_status(run, RUNNING, role="controller")
    assert get_status(run) == running and not running.final
    done = complete(run, role="controller")
    assert get_status(run).state == COMPLETE and done.final and done.time > 0
    with pytest.raises(StatusError, match="already COMPLETE.*reset=True"):
        set_status(run, RUNNING, role="controller")
    with pytest.raises(StatusError, match="already COMPLETE"):
        set_status(run, ABORTED, reason="late", role="trainer0")
    assert set_status(run, RUNNING, role="controller", reset=True).state == RUNNING


def test_abort_keeps_the_first_cause(tmp_path):
    run = RunDir(tmp_path)
    set_status(run, RUNNING, role="controller")
    first = abort(run, "trainer0 died (no heartbeat for 60 s)", role="controller")
    assert abort(run, "lost the controller", role="gen_server0") == first
    status = get_status(run)
    assert (status.state, status.role, status.reason) == (
        ABORTED,
        "controller",
        "trainer0 died (no heartbeat for 60 s)",
    )


def test_unknown_states_are_refused(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(StatusError, match="PAUSED"):
        set_status(run, "PAUSED")


# ledger


def test_ledger_records_consumed_ids_per_epoch(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    assert ledger.last_step() is None and ledger.consumed(0) == set()
    ledger.record(0, 1, ["a", "b"])
    ledger.record(0, 2, [3, 4])
    ledger.record(1, 3, ["a"])
    assert Ledger(tmp_path / "ledger.jsonl").consumed(0) == {"a", "b", "3", "4"}
    assert ledger.consumed(1) == {"a"}
    assert ledger.last_step() == 3 and ledger.last().epoch == 1


def test_a_torn_last_line_is_ignored_with_a_warning_and_cut_before_appending(tmp_path, caplog):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.record(0, 1, ["a"])
    ledger.record(0, 2, ["b"])
    with open(ledger.path, "ab") as f:
        f.write(b'{"epoch": 0, "step": 3, "ids": ["c", "d')  # a crash mid-write
    with caplog.at_level(logging.WARNING):
        assert Ledger(tmp_path / "ledger.jsonl").consumed(0) == {"a", "b"}
        assert Ledger(tmp_path / "ledger.jsonl").last_step() == 2
    assert "torn last line 3" in caplog.text

    caplog.clear()
    writer = Ledger(tmp_path / "ledger.jsonl")  # a restarted controller appends after the last whole line
    with caplog.at_level(logging.WARNING):
        writer.record(0, 3, ["c", "d"])
    assert "cutting a torn last line" in caplog.text
    assert writer.consumed(0) == {"a", "b", "c", "d"} and writer.last_step() == 3
    assert ledger.path.read_bytes().count(b"\n") == 3
