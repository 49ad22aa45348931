"""The run's timeline: roles record their phases as events (control/timeline.py), `areal-hpc trace` turns them
into a Perfetto trace and a per-step table (monitor/trace.py). Whole runs are traced in test_run_local.py (a
track per role and rank, the table summing to the step) and test_recover_local.py (both attempts)."""

from __future__ import annotations

import gc
import json
import time

import pytest

from areal_hpc.control import timeline
from areal_hpc.control.rundir import RunDir
from areal_hpc.monitor.trace import (
    Event,
    Spans,
    busy_secs,
    chrome_trace,
    read_timeline,
    select_steps,
    step_rows,
    steps_of,
    write_trace,
)
from tools import trace_rollout


def record(run: RunDir, task: str, attempt: int, events: list[tuple[str, float, float | None, dict]]) -> None:
    lines = [{"name": n, "ts": ts, **({} if d is None else {"dur": d}), **a} for n, ts, d, a in events]
    path = run.timeline_file(task, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))


def two_steps(run: RunDir) -> None:
    """A controller's two steps of 10 s, a trainer busy 6 s of each, a server asked 4 s of the first."""
    record(run, "controller", 0, [
        ("step", 100, 10, {"step": 1}), ("rollout", 100, 4, {}), ("actor_train", 104, 5.5, {}),
        ("generate", 100.5, 3, {"server": "gen_server0", "overlap": True}),
        ("step", 110, 10, {"step": 2}), ("rollout", 110, 4, {}), ("actor_train", 114, 5.6, {}),
        ("reward", 112, 1, {}),  # inside the rollout: not a part of its own
    ])  # fmt: skip
    record(run, "trainer0", 0, [
        ("start", 99, None, {}), ("train_step", 104, 6, {"step": 1}), ("load_batch", 104, 0.5, {}),
        ("train_step", 114, 6, {"step": 2}),
    ])  # fmt: skip
    record(run, "gen_server0", 0, [("start", 99, None, {}), ("update_weights", 105, 1, {})])


def test_a_full_garbage_collection_is_a_span(tmp_path):
    timeline.record(tmp_path / "trainer0.jsonl")
    try:
        gc.collect()
    finally:
        timeline.stop()
    events = [json.loads(line) for line in (tmp_path / "trainer0.jsonl").read_text().splitlines()]
    assert [e["name"] for e in events] == ["start", "gc"]
    assert events[1]["tracked"] > 0  # the objects a full collection walks: what makes one take 100 ms


def test_a_span_is_recorded_once_the_process_records(tmp_path):
    path = tmp_path / "timeline" / "trainer3.attempt1.jsonl"
    with timeline.span("nothing"):  # not recording: costs nothing, writes nothing
        pass
    timeline.record(path, attempt=1)
    try:
        with timeline.span("train_step", step=4) as args:
            args["tokens"] = 1024
        with timeline.span("generate", server="gen_server0", overlap=True):
            time.sleep(0.01)
    finally:
        timeline.stop()
    events, skipped = read_timeline(path.parent)
    assert skipped == 0
    assert [(e.task, e.attempt, e.name) for e in events if e.task == "trainer3"] == [
        ("trainer3", 1, "start"), ("trainer3", 1, "train_step"), ("trainer3", 1, "generate")
    ]  # fmt: skip
    step = next(e for e in events if e.name == "train_step")
    assert step.args == {"step": 4, "tokens": 1024} and step.dur >= 0
    # A request to a server shows on the server's track as well.
    assert [(e.task, e.args["from"]) for e in events if e.task == "gen_server0"] == [
        ("gen_server0", "trainer3")
    ]


def test_hostile_or_torn_lines_are_skipped_and_counted(tmp_path):
    run = RunDir(tmp_path)
    two_steps(run)
    with open(run.timeline_file("trainer0", 0), "a") as f:
        f.write(
            '[1, 2]\n{"name": "x", "ts": "soon"}\n{"name": "y", "ts": 1, "dur": -1}\n{"name": "z", "ts": 1'
        )
    (run.timeline / "notes.txt").write_text("not a timeline file")
    events, skipped = read_timeline(run.timeline)
    assert skipped == 4 and {e.name for e in events} >= {"step", "train_step"}
    out, table = write_trace(run, None)
    assert "4 line(s) of the timeline were no events" in table
    json.loads(out.read_text())


def test_the_step_table_gives_the_controllers_parts_and_each_roles_idle_share(tmp_path):
    run = RunDir(tmp_path)
    two_steps(run)
    events, _ = read_timeline(run.timeline)
    steps = steps_of(events)
    assert [(s.step, s.wall) for s in steps] == [(1, 10), (2, 10)]
    assert steps[1].parts == {"rollout": 4, "actor_train": pytest.approx(5.6)}  # reward is the rollout's
    rows = step_rows(events, steps)
    assert rows[0]["other"] == pytest.approx(0.5) and rows[1]["other"] == pytest.approx(0.4)
    assert rows[0]["idle trainer"] == pytest.approx(0.4)  # busy 6 of 10 s
    assert rows[0]["idle gen_server"] == pytest.approx(0.6)  # asked for 3 s + 1 s
    assert rows[1]["idle gen_server"] == pytest.approx(1.0)
    assert rows[0]["rollout"] == 4


def test_busy_time_is_the_union_of_spans_within_the_window():
    spans = [("a", 0, 4), ("b", 2, 4), ("c", 10, 1), ("d", -5, 6)]
    found = Spans([Event("t", 0, n, ts, d) for n, ts, d in spans])
    assert busy_secs(found, 0, 10) == pytest.approx(6)  # [0, 6] once, c starts at the window's end
    assert busy_secs(found, 5, 12) == pytest.approx(2)  # [5, 6] and [10, 11]


def test_steps_are_chosen_as_a_range_and_a_bad_range_is_named():
    class S:
        def __init__(self, step):
            self.step = step

    steps = [S(i) for i in range(1, 6)]
    assert [s.step for s in select_steps(steps, "2:3")] == [2, 3]
    assert [s.step for s in select_steps(steps, "4:")] == [4, 5]
    assert [s.step for s in select_steps(steps, ":2")] == [1, 2]
    assert [s.step for s in select_steps(steps, "5")] == [5]
    with pytest.raises(ValueError, match="--steps 'a:b'"):
        select_steps(steps, "a:b")


def test_the_trace_is_chrome_trace_event_json_with_a_track_per_task(tmp_path):
    run = RunDir(tmp_path)
    two_steps(run)
    events, _ = read_timeline(run.timeline)
    trace = chrome_trace(events, window=(110, 120))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"controller", "trainer0", "gen_server0"}
    for e in trace["traceEvents"]:
        assert e["ph"] in "MXibe" and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0
    # The window keeps what meets steps 2's time: not the first step's spans.
    assert not any(e.get("args", {}).get("step") == 1 for e in trace["traceEvents"])


def test_a_profile_joins_the_trace_on_the_timelines_clock(tmp_path):
    run = RunDir(tmp_path)
    two_steps(run)
    base_ns = 100 * 10**9  # the profile's clock: microseconds after 100 s
    kernel = {"ph": "X", "name": "gemm", "pid": 7, "tid": 7, "ts": 4_500_000, "dur": 10}
    (run.timeline / "profile.actor_train.step1.trainer0.json").write_text(
        json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": [kernel]})
    )
    for i, junk in enumerate(["[1]", '{"traceEvents": 5}', '{"baseTimeNanoseconds": "x"}', "{torn"]):
        (run.timeline / f"profile.junk{i}.json").write_text(junk)  # not profiles: left out
    out, _ = write_trace(run, tmp_path / "t.json", "1", cuda=True)
    trace = json.loads(out.read_text())
    (gemm,) = [e for e in trace["traceEvents"] if e["name"] == "gemm"]
    assert gemm["ts"] == pytest.approx(4.5e6)  # the step started at 100 s: 4.5 s into it
    labels = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "actor_train.step1.trainer0" in labels and not any(label.startswith("junk") for label in labels)


def test_tracing_a_run_without_a_timeline_or_profile_says_what_is_missing(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no timeline in"):
        write_trace(run, None)
    two_steps(run)
    with pytest.raises(FileNotFoundError, match="logging.profile_step"):
        write_trace(run, None, cuda=True)
    with pytest.raises(ValueError, match="no such finished step"):
        write_trace(run, None, "7:9")


def test_a_servers_rollout_reads_as_prefills_decode_stretches_and_answers(tmp_path, capsys):
    """tools/trace_rollout.py on a trace: the server's spans inside each controller rollout, in its seconds."""
    run = RunDir(tmp_path)
    record(run, "controller", 0, [("step", 100, 10, {"step": 1}), ("rollout", 100, 4, {})])
    record(run, "gen_server0", 0, [
        ("prefill", 100.01, 0.04, {"rows": 128, "tokens": 256}),
        ("decode", 100.05, 3.5, {"rows": 128, "steps": 1000}),
        ("gc", 103.6, 0.1, {"collected": 9}),
        ("respond", 103.7, 0.005, {"samples": 8, "overlap": True}),
    ])  # fmt: skip
    events, _ = read_timeline(run.timeline)
    path = tmp_path / "run.trace.json"
    path.write_text(json.dumps(chrome_trace(events)))
    [rollout] = trace_rollout.rollouts(json.loads(path.read_text()), "gen_server0")
    assert [s["name"] for s in rollout["spans"]] == ["prefill", "decode", "gc"]
    assert rollout["answers"] == [pytest.approx(3.7)]
    assert "3.500 ms a step" in trace_rollout.describe(rollout["spans"][1], rollout["lo"])
