"""File helpers of the run directory: atomic writes, reads of missing or damaged files, ESTALE retries."""

from __future__ import annotations

import errno
import os

import pytest

from areal_hpc.control import fsio


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
