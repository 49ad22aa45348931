"""The statistics reach TensorBoard and W&B under the original's names: event files TensorBoard's own reader
loads (a resumed attempt replaces the steps it runs again), and an offline W&B run whose history holds every
row over `global_step`."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.control import RunDir
from areal_hpc.launch.preflight import writer_problems
from areal_hpc.monitor import StatsLog, open_writers
from tests.helpers import tensorboard_scalars

REWARD = "ppo_actor/task_reward/avg"


def log_steps(run: RunDir, cfg, attempt: int, first_step: int, rows: list[tuple[int, dict]]) -> None:
    stats = StatsLog(run.stats, open_writers(cfg, run, attempt, first_step))
    for step, row in rows:
        stats.write(step, row)
    stats.close()


def test_tensorboard_holds_every_step_and_a_resume_replaces_the_steps_it_runs_again(tmp_path):
    cfg = load_config(overrides=["logging.tensorboard=true"])
    first = [(0, {"eval/greedy_acc": 0.2})] + [(s, {REWARD: s / 10, "timeperf/e2e": 1.5}) for s in (1, 2, 3)]
    run = RunDir(tmp_path)
    log_steps(run, cfg, attempt=0, first_step=0, rows=first)
    # The next attempt resumes from the checkpoint of step 1: steps 2 and 3 run again, with other values.
    log_steps(run, cfg, attempt=1, first_step=2, rows=[(2, {REWARD: 0.9}), (3, {REWARD: 0.8})])
    scalars = tensorboard_scalars(run.tensorboard)
    assert scalars[REWARD] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.9)), (3, pytest.approx(0.8))]
    assert scalars["eval/greedy_acc"] == [(0, pytest.approx(0.2))]
    assert [step for step, _ in scalars["timeperf/e2e"]] == [1]


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: a LevelDB-style log of protobuf records (a 7-byte header, 32 KiB blocks,
    each record chunk: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data, records, chunk, pos = path.read_bytes(), [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_history(folder: Path) -> list[dict]:
    """The history rows of the offline run in `folder`."""
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(path)
    assert records[-1].WhichOneof("record_type") == "exit", f"{path} is not written to its end"
    rows = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    named = [
        {item.key or "/".join(item.nested_key): float(item.value_json) for item in row.item} for row in rows
    ]
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in named]  # W&B's own: _step...


def test_an_offline_wandb_run_holds_every_row_over_the_global_step(tmp_path):
    pytest.importorskip("wandb")
    cfg = load_config(overrides=["logging.tensorboard=false", "logging.wandb=true", "trial_name=t1"])
    rows = [(1, {REWARD: 0.1}), (2, {REWARD: 0.2}), (1, {"eval/math_500/greedy_acc": 0.5})]  # a late eval
    run = RunDir(tmp_path)
    log_steps(run, cfg, attempt=0, first_step=0, rows=rows)
    assert wandb_history(run.wandb) == [
        {REWARD: 0.1, "global_step": 1},
        {REWARD: 0.2, "global_step": 2},
        {"eval/math_500/greedy_acc": 0.5, "global_step": 1},
    ]


def test_a_writer_whose_library_is_missing_is_refused_before_the_run(monkeypatch):
    cfg = load_config(overrides=["logging.wandb=true"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert writer_problems(cfg) == [
        "'logging.tensorboard' is true, but tensorboard is not installed: pip install 'tensorboard', "
        "or set logging.tensorboard=false",
        "'logging.wandb' is true, but wandb is not installed: pip install 'areal-hpc[wandb]', "
        "or set logging.wandb=false",
    ]
