"""Mailboxes: round trips between real processes, exactly-once consumption, remote errors, timeouts."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from areal_hpc.control import Inbox, Mailbox, RemoteError, ReplyTimeout, fsio

SPAWN = multiprocessing.get_context("spawn")


def _explode(payload):
    raise ValueError(f"bad input {payload}")


def _echo_worker(run_dir: str) -> None:
    """A bare Inbox loop in a child process: echo, fail or stop."""
    inbox = Inbox(run_dir, "echo")
    while True:
        for request in inbox.poll():
            if request.type == "stop":
                inbox.reply(request, "bye")
                return
            try:
                inbox.reply(
                    request,
                    {"echo": request.payload} if request.type == "echo" else _explode(request.payload),
                )
            except ValueError as exc:
                inbox.reply_error(request, exc)
        time.sleep(0.001)


def _greedy_poller(run_dir: str, out: str, stop: str) -> None:
    """Take whatever requests come until ``stop`` exists, then write their ids to ``out``."""
    inbox = Inbox(run_dir, "shared")
    Path(out + ".ready").touch()
    taken = []
    while not Path(stop).exists():
        taken += [r.id for r in inbox.poll()]
        time.sleep(0.0005)
    taken += [r.id for r in inbox.poll()]
    Path(out).write_text(json.dumps(taken))


def test_round_trip_with_a_worker_process_and_its_remote_error(tmp_path):
    child = SPAWN.Process(target=_echo_worker, args=(str(tmp_path),))
    child.start()
    try:
        box = Mailbox(tmp_path)
        ids = [box.post("echo", "echo", {"i": i}) for i in range(20)]
        assert [box.wait_reply("echo", rid, timeout=30) for rid in ids] == [
            {"echo": {"i": i}} for i in range(20)
        ]
        assert box.request("echo", "echo", [1, "two"], timeout=30) == {"echo": [1, "two"]}

        rid = box.post("echo", "boom", 7)
        with pytest.raises(RemoteError) as info:
            box.wait_reply("echo", rid, timeout=30)
        err = info.value
        assert (err.worker, err.request_type, err.request_id) == ("echo", "boom", rid)
        assert err.error_type == "ValueError" and err.message == "bad input 7"
        assert "_explode" in err.traceback and "_explode" in str(err) and rid in str(err)

        assert box.request("echo", "stop", timeout=30) == "bye"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert fsio.list_names(tmp_path / "mailbox" / "echo" / "replies") == []  # the caller took its replies


def test_each_request_is_consumed_exactly_once_by_racing_pollers(tmp_path):
    stop = tmp_path / "stop"
    outs = [tmp_path / f"taken{i}.json" for i in range(3)]
    pollers = [SPAWN.Process(target=_greedy_poller, args=(str(tmp_path), str(o), str(stop))) for o in outs]
    for p in pollers:
        p.start()
    deadline = time.monotonic() + 30
    while not all(Path(f"{o}.ready").exists() for o in outs) and time.monotonic() < deadline:
        time.sleep(0.01)  # post while all of them poll, so that they race
    box = Mailbox(tmp_path)
    posted = [box.post("shared", "work", i) for i in range(200)]
    deadline = time.monotonic() + 30
    while fsio.list_names(tmp_path / "mailbox" / "shared" / "requests") and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.touch()
    for p in pollers:
        p.join(timeout=30)
    taken = [rid for o in outs for rid in json.loads(o.read_text())]
    assert len(taken) == len(set(taken)) == 200
    assert set(taken) == set(posted)


def test_poll_returns_requests_in_posting_order_with_their_fields(tmp_path):
    box = Mailbox(tmp_path)
    ids = [box.post("w", f"t{i}", {"i": i}) for i in range(30)]
    box.post("w", "train_step", None, pre_hooks=["data_transfer", ("param_realloc", {"to": 1})], group_size=4)
    inbox = Inbox(tmp_path, "w")
    requests = inbox.poll()
    assert [r.id for r in requests[:30]] == ids == sorted(ids)
    assert [r.payload for r in requests[:30]] == [{"i": i} for i in range(30)]
    last = requests[-1]
    assert last.pre_hooks == ({"name": "data_transfer"}, {"name": "param_realloc", "payload": {"to": 1}})
    assert last.group_size == 4 and last.post_hooks == () and last.worker == "w"
    assert inbox.poll() == []


def test_wait_reply_timeout_names_worker_type_and_id(tmp_path):
    box = Mailbox(tmp_path)
    rid = box.post("trainer0", "train_step", {})
    with pytest.raises(ReplyTimeout) as info:
        box.wait_reply("trainer0", rid, timeout=0.1)
    text = str(info.value)
    assert "'trainer0'" in text and "'train_step'" in text and rid in text and "still in its inbox" in text
    assert isinstance(info.value, TimeoutError)


def test_results_that_are_not_json_become_error_replies(tmp_path):
    box = Mailbox(tmp_path)
    rid = box.post("w", "spec")
    inbox = Inbox(tmp_path, "w")
    [request] = inbox.poll()
    inbox.reply(request, {"obj": object()})
    with pytest.raises(RemoteError, match="TypeError"):
        box.wait_reply("w", rid, timeout=5)


def test_bad_worker_names_and_payloads_are_refused(tmp_path):
    box = Mailbox(tmp_path)
    with pytest.raises(ValueError, match="worker name"):
        box.post("../etc", "spec")
    with pytest.raises(TypeError, match="not JSON"):
        box.post("w", "spec", {1, 2})
    with pytest.raises(ValueError, match="hook"):
        box.post("w", "train_step", pre_hooks=[42])
