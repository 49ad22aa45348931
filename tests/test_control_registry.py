"""File helpers and the registry: atomic writes, ESTALE retries, key safety, TTLs, waits."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from areal_hpc.control import KeyExistsError, Registry, RegistryTimeout, fsio
from areal_hpc.control import registry as registry_module

# fsio


def test_write_json_is_atomic_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "a" / "b.json"
    fsio.write_json(path, {"x": 1})
    fsio.write_json(path, {"x": 2}, fsync=True)
    assert fsio.read_json(path) == {"x": 2}
    assert os.listdir(path.parent) == ["b.json"]


def test_read_json_of_a_missing_file_is_the_default(tmp_path):
    assert fsio.read_json(tmp_path / "nope.json") is None
    assert fsio.read_json(tmp_path / "nope.json", default=7) == 7


def test_read_json_of_garbage_names_the_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        fsio.read_json(tmp_path / "bad.json")


def test_write_json_refuses_values_that_are_not_json(tmp_path):
    with pytest.raises(TypeError, match="v.json"):
        fsio.write_json(tmp_path / "v.json", {"x": object()})
    assert fsio.list_names(tmp_path) == []


def test_create_json_creates_only_once(tmp_path):
    assert fsio.create_json(tmp_path / "k.json", 1)
    assert not fsio.create_json(tmp_path / "k.json", 2)
    assert fsio.read_json(tmp_path / "k.json") == 1
    assert os.listdir(tmp_path) == ["k.json"]


def test_retry_estale_retries_then_gives_up_naming_the_file(monkeypatch):
    monkeypatch.setattr(fsio, "ESTALE_SLEEP", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.ESTALE, "Stale file handle")
        return "ok"

    assert fsio.retry_estale(flaky, "f") == "ok" and len(calls) == 3

    def stale():
        raise OSError(errno.ESTALE, "Stale file handle")

    with pytest.raises(OSError, match="/shared/x.json"):
        fsio.retry_estale(stale, "/shared/x.json")


# registry


def test_add_get_replace_delete(tmp_path):
    reg = Registry(tmp_path)
    reg.add("gen_servers/0", {"url": "http://a:1"})
    assert reg.get("gen_servers/0") == {"url": "http://a:1"}
    with pytest.raises(KeyExistsError, match="gen_servers/0"):
        reg.add("gen_servers/0", {"url": "http://b:2"})
    reg.add("gen_servers/0", {"url": "http://b:2"}, replace=True)
    assert reg.get("gen_servers/0") == {"url": "http://b:2"}
    assert reg.delete("gen_servers/0") and not reg.delete("gen_servers/0")
    assert reg.get("gen_servers/0", default=None) is None
    with pytest.raises(KeyError, match="gen_servers/0"):
        reg.get("gen_servers/0")


def test_subtree_lists_a_prefix_and_nothing_beside_it(tmp_path):
    reg = Registry(tmp_path)
    reg.add("gen_servers/0", "a")
    reg.add("gen_servers/1", "b")
    reg.add("gen_servers/1/extra", "c")
    reg.add("gen_servers_old/0", "x")
    reg.add("trainer", "t")
    assert reg.subtree("gen_servers") == {
        "gen_servers/0": "a",
        "gen_servers/1": "b",
        "gen_servers/1/extra": "c",
    }
    assert reg.subtree("gen_servers/1/") == {"gen_servers/1": "b", "gen_servers/1/extra": "c"}
    assert set(reg.subtree()) == {
        "gen_servers/0",
        "gen_servers/1",
        "gen_servers/1/extra",
        "gen_servers_old/0",
        "trainer",
    }
    assert reg.subtree("nothing") == {}


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../x", "a/../b", "a//b", ".hidden", "a/./b", "a\\b", "x.json", "a b"]
)
def test_unsafe_keys_are_refused(tmp_path, key):
    reg = Registry(tmp_path / "run")
    with pytest.raises(ValueError, match="registry key"):
        reg.add(key, 1)
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "run" / "registry").exists()


def test_racing_adders_of_one_key_have_one_winner(tmp_path):
    reg = Registry(tmp_path)
    wins = []

    def adder(i):
        try:
            reg.add("leader", i)
            wins.append(i)
        except KeyExistsError:
            pass

    threads = [threading.Thread(target=adder, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and reg.get("leader") == wins[0]


class FakeClock:
    """Stands in for the registry's ``time`` module, so TTL tests do not depend on the machine's load."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(registry_module, "time", fake)
    return fake


def test_ttl_entry_expires_without_keepalive_and_can_be_added_again(tmp_path, clock):
    reg = Registry(tmp_path)
    reg.add("lease", "first", ttl=2)
    clock.now += 1.9
    assert reg.get("lease") == "first"
    clock.now += 0.2
    assert reg.get("lease", None) is None
    assert reg.subtree() == {}
    with pytest.raises(KeyError, match="lease"):
        reg.keepalive("lease")
    reg.add("lease", "second", ttl=10)  # the expired entry counts as absent
    assert reg.get("lease") == "second"


def test_keepalive_keeps_a_ttl_entry(tmp_path, clock):
    reg = Registry(tmp_path)
    reg.add("lease", 1, ttl=2)
    for _ in range(5):
        clock.now += 1.5
        reg.keepalive("lease")
    assert reg.get("lease") == 1
    with pytest.raises(KeyExistsError):
        reg.add("lease", 2)
    clock.now += 2.5
    reg.add("lease", 2)


def test_gc_deletes_only_expired_entries(tmp_path, clock):
    reg = Registry(tmp_path)
    reg.add("a/old", 1, ttl=1)
    reg.add("a/live", 2, ttl=60)
    reg.add("a/forever", 3)
    clock.now += 2
    assert reg.gc() == ["a/old"]
    assert not reg.path("a/old").exists()
    assert reg.subtree("a") == {"a/forever": 3, "a/live": 2}


def test_ttl_expiry_in_real_time(tmp_path):
    reg = Registry(tmp_path)
    reg.add("lease", 1, ttl=0.05)
    time.sleep(0.1)
    assert reg.get("lease", None) is None


def test_wait_returns_a_value_added_later(tmp_path):
    reg = Registry(tmp_path)
    threading.Timer(0.1, reg.add, args=("trainer/ready", {"rank": 0})).start()
    assert reg.wait("trainer/ready", timeout=10) == {"rank": 0}


def test_wait_timeout_names_the_key_and_the_wait(tmp_path):
    reg = Registry(tmp_path)
    start = time.monotonic()
    with pytest.raises(RegistryTimeout, match=r"0\.2 s waiting for registry key 'gen_servers/3'") as info:
        reg.wait("gen_servers/3", timeout=0.2, poll=0.01)
    assert isinstance(info.value, TimeoutError)
    assert 0.2 <= time.monotonic() - start < 5
