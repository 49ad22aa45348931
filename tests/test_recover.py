"""Recover checkpoints, recover_mode, rewinding a run directory and beginning an attempt: the parts, alone."""

from __future__ import annotations

import errno
import json
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

from areal_hpc.config import load_config
from areal_hpc.control import fsio
from areal_hpc.control.ledger import Ledger
from areal_hpc.control.rundir import RunDir
from areal_hpc.control.status import ABORTED, complete, set_status
from areal_hpc.data.store import RolloutStore
from areal_hpc.gen.rollout_worker import used_prompts
from areal_hpc.master.checkpoint import write_time_warning
from areal_hpc.master.guard import StepGuard
from areal_hpc.master.loop import Master
from areal_hpc.master.sources import StepBatch, StoreRollouts
from areal_hpc.master.turns import Turns
from areal_hpc.monitor.stats import StatsLog, read_stats
from areal_hpc.recover import attempt
from areal_hpc.recover.checkpoint import Checkpoints
from areal_hpc.recover.rewind import rewind, save_into
from areal_hpc.recover.state import RecoverError, check_compatible, identity, resumes
from tests.helpers import REPO_ROOT


def write_checkpoint(ckpts: Checkpoints, step: int) -> None:
    tmp = ckpts.begin(step)
    (tmp / "trainer0.pt").write_bytes(b"x" * 100)
    fsio.write_json(tmp / "controller.json", {"global_step": step})
    ckpts.commit(tmp, step)


def test_a_checkpoint_appears_whole_under_its_name_and_only_the_newest_are_kept(tmp_path):
    ckpts = Checkpoints(RunDir(tmp_path).recover, keep=2)
    for step in (2, 4, 6):
        write_checkpoint(ckpts, step)
    assert ckpts.steps() == [4, 6]
    assert ckpts.latest() == tmp_path / "recover" / "step00000006"
    assert json.loads((ckpts.latest() / "manifest.json").read_text())["step"] == 6


def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_the_file(tmp_path, caplog):
    ckpts = Checkpoints(RunDir(tmp_path).recover, keep=3)
    for step in (2, 4):
        write_checkpoint(ckpts, step)
    bad = ckpts.path(4) / "trainer0.pt"
    bad.write_bytes(b"x" * 10)  # truncated
    with caplog.at_level(logging.WARNING):
        assert ckpts.latest() == ckpts.path(2)
    assert str(bad) in caplog.text


def test_a_checkpoint_whose_writer_died_is_never_used(tmp_path):
    ckpts = Checkpoints(RunDir(tmp_path).recover)
    write_checkpoint(ckpts, 2)
    (ckpts.begin(4) / "trainer0.pt").write_bytes(b"half")  # crashed before commit: a hidden folder
    assert ckpts.steps() == [2] and ckpts.latest() == ckpts.path(2)
    write_checkpoint(ckpts, 4)  # the next writer replaces the leftover
    assert ckpts.latest() == ckpts.path(4)


def test_a_changed_setting_is_named_with_both_values(tmp_path):
    cfg = load_config([REPO_ROOT / "configs/toy-cpu.yaml"], ["trial_name=a"])
    saved = identity(cfg) | {"dataset.train_bs_n_seqs": 32}
    with pytest.raises(RecoverError, match=r"dataset.train_bs_n_seqs was 32 .* is now 64"):
        check_compatible(saved, cfg, "ckpt")
    check_compatible(identity(cfg), cfg, "ckpt")


@pytest.mark.parametrize(
    "mode, attempt, found, expected",
    [
        ("auto", 0, True, True), ("auto", 0, False, False), ("auto", 3, True, True),
        ("fault", 0, True, False), ("fault", 1, True, True), ("fault", 1, False, False),
        ("resume", 0, True, True), ("disabled", 1, True, False),
    ],
)  # fmt: skip
def test_recover_mode_decides_whether_an_attempt_resumes(mode, attempt, found, expected):
    assert resumes(mode, attempt, found, "here") is expected


def test_recover_mode_resume_without_a_checkpoint_is_an_error():
    with pytest.raises(RecoverError, match="recover_mode is resume but here holds no valid"):
        resumes("resume", 0, False, "here")


def test_rewinding_removes_every_trace_of_steps_after_the_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    ledger, stats = Ledger(run.ledger), StatsLog(run.stats)
    for step in (1, 2, 3):
        ledger.record(0, step, [f"q{step}"])
        stats.write(step, {"loss": float(step)})
        (run.checkpoint("actor", 0, step, step)).mkdir(parents=True)
        if step == 2:  # the checkpoint saves the ledger and the store of this moment
            (tmp_path / "rollouts").mkdir()
            (tmp_path / "rollouts" / "early.h5").write_bytes(b"in the checkpoint")
            saved = tmp_path / "recover" / "step00000002"
            saved.mkdir(parents=True)
            save_into(run, saved)
    (run.step_data(3)).mkdir(parents=True)
    (tmp_path / "rollouts" / "early.h5").unlink()  # trained on by step 3
    (tmp_path / "rollouts" / "late.h5").write_bytes(b"made after the checkpoint")

    rewind(run, step=2, version=2, saved=saved)

    assert [r.step for r in ledger.records()] == [1, 2]
    assert [r["step"] for r in read_stats(run.stats)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "actor").iterdir()) == [
        "epoch0epochstep1globalstep1",
        "epoch0epochstep2globalstep2",
    ]
    assert not (tmp_path / "data").exists()
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["early.h5"]
    assert fsio.read_json(run.published_version) == {"version": 2}


def test_a_ledger_restore_that_fails_halfway_leaves_the_old_ledger_whole(tmp_path, monkeypatch):
    run, saved = RunDir(tmp_path), tmp_path / "recover" / "step00000001"
    Ledger(run.ledger).record(0, 1, ["q1"])
    saved.mkdir(parents=True)
    save_into(run, saved)
    Ledger(run.ledger).record(0, 2, ["q2"])
    before = run.ledger.read_bytes()
    real_write, real_sendfile = os.write, os.sendfile

    def write(fd, data):  # the disk fills up: a few bytes land, then the write fails
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def sendfile(out_fd, in_fd, offset, count):  # how shutil copies a file on Linux
        real_sendfile(out_fd, in_fd, offset, 5)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "sendfile", sendfile)
    with pytest.raises(OSError, match="No space left"):
        rewind(run, step=1, version=1, saved=saved)
    monkeypatch.undo()
    assert run.ledger.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.ledger.name, "recover"]  # no partial copy


def test_a_fresh_start_in_a_used_directory_clears_the_earlier_attempts_traces(tmp_path):
    run = RunDir(tmp_path)
    Ledger(run.ledger).record(0, 1, ["q1"])
    StatsLog(run.stats).write(1, {"loss": 1.0})
    rewind(run, step=0, version=0)
    assert list(Ledger(run.ledger).records()) == [] and read_stats(run.stats) == []


def test_each_attempt_gets_its_log_folder_and_a_clean_coordination_state(tmp_path):
    run = RunDir(tmp_path)
    assert attempt.begin_attempt(run) == 0
    set_status(run, ABORTED, reason="trainer0 died")
    fsio.write_json(tmp_path / "heartbeat" / "controller.json", {"state": "alive"})
    fsio.write_json(run.gen_address(0), {"url": "http://dead"})
    run.dist_init.write_text("")
    assert attempt.begin_attempt(run) == 1
    assert run.attempt_logs(1).is_dir()
    assert json.loads((run.attempt_logs(0) / "status.json").read_text())["reason"] == "trainer0 died"
    assert not any(p.exists() for p in (run.root / "status.json", run.root / "heartbeat", run.gen_address(0)))
    assert not run.dist_init.exists()


def test_a_finished_run_begins_no_attempt(tmp_path, capsys):
    complete(RunDir(tmp_path), "controller")
    assert attempt.main(["--run-dir", str(tmp_path)]) == attempt.EXIT_FINISHED
    assert "finished" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_a_resumed_rollout_side_skips_prompts_trained_on_waiting_or_dropped(tmp_path):
    ledger, store = Ledger(RunDir(tmp_path).ledger), RolloutStore(RunDir(tmp_path).rollouts)
    ledger.record(0, 1, ["a", "b"])
    ledger.record(1, 2, ["a"])
    arrays = {
        "packed_input_ids": np.arange(3, dtype=np.int64),
        "cu_seqlens": np.array([0, 3], dtype=np.int64),
    }
    store.put(0, 1, 1.0, arrays, {"query_id": "c", "epoch": 0})
    store.put_dropped(0, 2, 2.0, "d", 1)
    done, n_stored = used_prompts(ledger, store)
    assert done == {0: {"a", "b", "c"}, 1: {"a", "d"}} and n_stored == 1


def test_a_step_records_its_groups_and_the_dropped_ones_by_prompt_epoch(tmp_path):
    run = RunDir(tmp_path)
    source = StoreRollouts(load_config(), run, StepGuard())
    source.store.put_dropped(0, 7, 1.0, "d", 1)
    source.dropped = source.store.dropped()  # as `next` takes them with the step's groups
    dropped = [("d", 1, "agent_error"), ("e", 1, "timeout"), ("f", 1, "agent_error")]
    source.consumed(4, StepBatch([], [("a", 0), ("b", 1)], dropped=dropped))  # step 4 ends: recorded as 5
    records = [(r.epoch, r.step, r.ids, r.dropped, r.reason) for r in Ledger(run.ledger).records()]
    assert records == [(0, 5, ("a",), False, None), (1, 5, ("b",), False, None),
                       (1, 5, ("d", "f"), True, "agent_error"), (1, 5, ("e",), True, "timeout")]  # fmt: skip
    assert source.store.dropped() == []  # recorded once


def test_a_publish_that_fails_after_sigterm_is_skipped_so_that_the_step_can_be_checkpointed(tmp_path):
    class ServersGone:
        def publish(self, version: int) -> dict:
            raise ConnectionResetError("server 0 is gone")

    guard = StepGuard()
    master = SimpleNamespace(
        counter=SimpleNamespace(version=3), guard=guard, publisher=ServersGone(), rundir=RunDir(tmp_path),
        turns=Turns([], colocated=False, timeout=1.0),
    )  # fmt: skip
    with pytest.raises(ConnectionResetError):  # without a notice a failed publication fails the run
        Master.publish(master)
    guard.notice.urgent = True  # SIGTERM came while the servers took the weights
    assert Master.publish(master) == {}
    assert master.counter.version == 5  # the trainers hold it; a resume republishes it


def test_a_checkpoint_slower_than_a_signal_allows_is_warned_about():
    assert write_time_warning(12.0, signal_grace_secs=120) is None
    warning = write_time_warning(45.0, signal_grace_secs=120)
    assert "45 s" in warning and "KillWait (30 s" in warning and "signal_grace_secs" in warning
    assert "10 s of cluster.slurm.signal_grace_secs" in write_time_warning(12.0, signal_grace_secs=10)
