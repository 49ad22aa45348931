"""Disk publication: snapshots carry a manifest written last; a server refuses a snapshot without a valid one."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from areal_hpc.control.manifest import MANIFEST, SnapshotError, verify_snapshot, write_manifest
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.weights.publisher import DiskPublisher
from tests.test_weights_broadcast import GREEDY, PROMPT, check_greedy_under, perturbed_trainer

TOKEN = "disk-test-token"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    """The built-in server in this process (engine thread + HTTP thread), spoken to over real HTTP."""
    engine = Engine(str(tiny_model_dir), seed=1).start()
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), TOKEN)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", TOKEN, timeout=60)
    httpd.shutdown()
    httpd.server_close()
    engine.stop()


@pytest.fixture
def snapshot(tiny_model_dir, tmp_path):
    """A copy of the tiny model with its manifest."""
    folder = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, folder)
    write_manifest(folder)
    return folder


def test_the_manifest_lists_every_file_with_size_and_sha256(snapshot):
    manifest = json.loads((snapshot / MANIFEST).read_text())
    files = {p.name for p in snapshot.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == files and "model.safetensors" in files
    weights = manifest["files"]["model.safetensors"]
    assert weights["size"] == (snapshot / "model.safetensors").stat().st_size and len(weights["sha256"]) == 64
    assert verify_snapshot(snapshot) == manifest


def test_a_damaged_or_incomplete_snapshot_is_refused_naming_the_file(snapshot):
    weights = snapshot / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    weights.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=rf"{weights}: sha256 differs"):
        verify_snapshot(snapshot)
    weights.write_bytes(bytes(data[:-10]))
    with pytest.raises(SnapshotError, match=rf"{weights} has {len(data) - 10} bytes, its manifest says"):
        verify_snapshot(snapshot)
    write_manifest(snapshot)
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"late")
    with pytest.raises(SnapshotError, match="model-00002-of-00002.safetensors is not listed in"):
        verify_snapshot(snapshot)
    (snapshot / MANIFEST).write_text('{"format": "areal_hpc.snapshot/1", "files": ')
    with pytest.raises(SnapshotError, match=rf"{snapshot / MANIFEST} is not a valid manifest"):
        verify_snapshot(snapshot)
    (snapshot / MANIFEST).unlink()
    with pytest.raises(SnapshotError, match=rf"{snapshot / MANIFEST} is missing: the snapshot is incomplete"):
        verify_snapshot(snapshot)


def test_the_server_refuses_a_snapshot_its_manifest_does_not_match_and_loads_a_plain_hf_directory(
    client, snapshot
):
    version = client.model_info()["weight_version"]
    (snapshot / MANIFEST).write_text("[]")
    with pytest.raises(
        GenServerError, match=rf"HTTP 400.*{snapshot / MANIFEST} is not a snapshot manifest"
    ) as err:
        client.update_weights_from_disk(str(snapshot), weight_version=99)
    assert err.value.status == 400 and client.model_info()["weight_version"] == version
    write_manifest(snapshot)
    assert client.update_weights_from_disk(str(snapshot), weight_version=99)["weight_version"] == "99"
    (snapshot / MANIFEST).unlink()  # a plain HF directory, as AReaL's trainer saves one: SGLang loads it
    assert client.update_weights_from_disk(str(snapshot), weight_version=100)["weight_version"] == "100"


class SavingTrainers:
    """The trainer group as DiskPublisher uses it: `save` on every rank (here one, in this process)."""

    def __init__(self, handlers):
        self.handlers = handlers

    def call_all(self, type: str, payload: dict) -> list:
        return [getattr(self.handlers, type)(payload)]


def test_disk_publisher_saves_loads_and_removes_the_previous_snapshot(client, tiny_model_dir, tmp_path):
    handlers = perturbed_trainer(tiny_model_dir, seed=2)
    publisher = DiskPublisher(
        lambda v: tmp_path / "weights" / f"v{v}", SavingTrainers(handlers), [client], 60
    )
    stats = publisher.publish(1)
    snapshot = tmp_path / "weights" / "v1"
    manifest = verify_snapshot(snapshot)  # written by the trainer's save_hf, last
    assert stats["weight_sync/bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert stats["timeperf/weight_sync"] > 0
    out = client.generate(PROMPT, GREEDY)[0]
    assert out["meta_info"]["weight_version"] == "1"
    check_greedy_under(handlers.engines["actor"].model, out)

    with torch.no_grad():
        handlers.engines["actor"].model.model.norm.weight.mul_(0.5)
    publisher.publish(2)
    assert not snapshot.exists() and (tmp_path / "weights" / "v2" / MANIFEST).is_file()
    check_greedy_under(handlers.engines["actor"].model, client.generate(PROMPT, GREEDY)[0])
    assert client.model_info()["weight_version"] == "2"
