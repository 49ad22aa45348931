"""The model worker's flush semantics: the pure ordering, the server in-process and in a child process."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from areal_hpc.control import (
    Inbox,
    Mailbox,
    RemoteError,
    ReplyTimeout,
    Request,
    RunDir,
    WorkerServer,
    last_beat,
)
from areal_hpc.control.flush import flush_plan

SPAWN = multiprocessing.get_context("spawn")


def _req(rid: str, type: str = "train_step", group: int = 1, pre=(), post=()) -> Request:
    hooks = lambda names: tuple({"name": n} for n in names)  # noqa: E731
    return Request(rid, type, {"rid": rid}, "w", hooks(pre), hooks(post), group)


def test_flush_plan_runs_pre_hooks_then_smallest_groups_then_post_hooks():
    queued = [
        _req("a", group=4, pre=["data_transfer"], post=["save"]),
        _req("b", group=1, pre=["param_realloc"], post=["param_realloc", "offload"]),
        _req("c", group=2),
        _req("d", group=1, pre=["data_transfer"]),
    ]
    plan = [(s.phase, s.request.id, s.hook and s.hook["name"]) for s in flush_plan(queued)]
    assert plan == [
        ("pre", "a", "data_transfer"),
        ("pre", "b", "param_realloc"),
        ("pre", "d", "data_transfer"),
        ("compute", "b", None),  # group 1, posted before d: ties keep posting order
        ("compute", "d", None),
        ("compute", "c", None),
        ("compute", "a", None),
        ("post", "a", "save"),
        ("post", "b", "param_realloc"),
        ("post", "b", "offload"),
    ]
    assert flush_plan([]) == []


class Recorder:
    """Handlers and hooks that log what ran, in order."""

    def __init__(self) -> None:
        self.events: list[list] = []

    def _log(self, *event):
        self.events.append(list(event))

    def model_config(self, payload):
        return {"hidden": 8, "events": self.events}

    def train_step(self, payload):
        self._log("train_step", payload)
        return {"loss": 1.5}

    def inference(self, payload):
        self._log("inference", payload)
        return [1, 2]

    def generate(self, payload):
        self._log("generate", payload)
        return "text"

    def reset(self, payload):
        raise RuntimeError("cannot reset now")

    def data_transfer(self, payload):
        self._log("data_transfer", payload)

    def param_realloc(self, payload):
        self._log("param_realloc", payload)

    def save(self, payload):
        self._log("save", payload)


def _serve_recorder(run_dir: str) -> None:
    WorkerServer(RunDir(Path(run_dir)), "trainer0", Recorder(), heartbeat_interval=0.1).serve()


def test_worker_server_end_to_end_in_a_child_process(tmp_path):
    child = SPAWN.Process(target=_serve_recorder, args=(str(tmp_path),))
    child.start()
    box = Mailbox(RunDir(tmp_path).mailboxes)
    try:
        train = box.post(
            "trainer0", "train_step", "t", pre_hooks=["data_transfer"], post_hooks=["save"], group_size=4
        )
        infer = box.post("trainer0", "inference", "i", pre_hooks=[("param_realloc", "to-inf")], group_size=1)
        gen = box.post("trainer0", "generate", "g", group_size=2)
        empty = box.post("trainer0", "empty", None, post_hooks=[("save", "ckpt")])
        # Non-blocking requests are answered while the blocking ones wait for the flush.
        assert box.request("trainer0", "model_config", timeout=30) == {"hidden": 8, "events": []}
        with pytest.raises(ReplyTimeout, match="took the request"):
            box.wait_reply("trainer0", train, timeout=0.3)
        flushed = box.request("trainer0", "flush", timeout=30)
        assert flushed == {"done": [train, infer, gen, empty], "failed": []}
        assert box.wait_reply("trainer0", train, timeout=30) == {"loss": 1.5}
        assert box.wait_reply("trainer0", infer, timeout=30) == [1, 2]
        assert box.wait_reply("trainer0", gen, timeout=30) == "text"
        assert box.wait_reply("trainer0", empty, timeout=30) is None
        assert box.request("trainer0", "model_config", timeout=30)["events"] == [
            ["data_transfer", "t"],
            ["param_realloc", "to-inf"],
            ["inference", "i"],
            ["generate", "g"],
            ["train_step", "t"],
            ["save", "t"],
            ["save", "ckpt"],
        ]

        # A failing handler becomes an error reply; the worker keeps serving.
        with pytest.raises(RemoteError, match="unknown_thing"):
            box.request("trainer0", "unknown_thing", timeout=30)
        reset = box.post("trainer0", "reset")
        box.request("trainer0", "flush", timeout=30)
        with pytest.raises(RemoteError, match="cannot reset now") as info:
            box.wait_reply("trainer0", reset, timeout=30)
        assert info.value.error_type == "RuntimeError" and "def reset" not in info.value.message
        assert box.request("trainer0", "model_config", timeout=30)["hidden"] == 8

        # Stop: a request still queued is answered with an error, then the worker ends cleanly.
        orphan = box.post("trainer0", "train_step", "late")
        assert box.request("trainer0", "stop", timeout=30) == {"stopped": True}
        with pytest.raises(RemoteError, match="stop request came before a flush"):
            box.wait_reply("trainer0", orphan, timeout=30)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert last_beat(RunDir(tmp_path).heartbeats, "trainer0")["state"] == "stopped"


def _server(tmp_path, handlers, hooks=None, **options) -> tuple[Mailbox, Inbox, WorkerServer]:
    run = RunDir(tmp_path)
    return (
        Mailbox(run.mailboxes),
        Inbox(run.mailboxes, "w"),
        WorkerServer(run, "w", handlers, hooks, **options),
    )


def test_a_failing_pre_hook_skips_its_request_only(tmp_path):
    ran = []
    handlers = {"train_step": lambda p: ran.append(p) or p}
    hooks = {"data_transfer": lambda p: 1 / 0}
    box, inbox, server = _server(tmp_path, handlers, hooks)
    bad = box.post("w", "train_step", "bad", pre_hooks=["data_transfer"])
    good = box.post("w", "train_step", "good")
    missing = box.post("w", "train_step", "x", post_hooks=["evaluate"])
    box.post("w", "flush")
    for request in inbox.poll():
        server.handle(request)
    with pytest.raises(RemoteError, match="ZeroDivisionError"):
        box.wait_reply("w", bad, timeout=5)
    assert box.wait_reply("w", good, timeout=5) == "good"
    with pytest.raises(RemoteError, match="no post-hook 'evaluate'"):
        box.wait_reply("w", missing, timeout=5)
    assert ran == ["good", "x"]


def test_extra_blocking_names_wait_for_the_flush(tmp_path):
    box, inbox, server = _server(
        tmp_path, {"my_mfc": lambda p: p * 2, "spec": lambda p: 3}, blocking=["my_mfc"]
    )
    mfc = box.post("w", "my_mfc", 21)
    spec = box.post("w", "spec")
    for request in inbox.poll():
        server.handle(request)
    assert box.wait_reply("w", spec, timeout=5) == 3
    assert [r.id for r in server.queue] == [mfc]
    assert server.flush() == {"done": [mfc], "failed": []}
    assert box.wait_reply("w", mfc, timeout=5) == 42


def test_stop_from_another_thread_answers_queued_requests(tmp_path):
    box, _, server = _server(tmp_path, {}, heartbeat_interval=0.05)
    queued = box.post("w", "inference")
    threading.Timer(0.3, server.stop).start()
    server.serve()
    with pytest.raises(RemoteError, match="WorkerStopped"):
        box.wait_reply("w", queued, timeout=5)
    assert last_beat(RunDir(tmp_path).heartbeats, "w")["state"] == "stopped"
