"""Weight broadcast over gloo: this process is trainer rank 0 (the real trainer handlers, no mailbox), a
built-in server subprocess is rank 1; the controller's BroadcastPublisher drives both."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_hpc.config.schema import ExperimentConfig, TrainedModelConfig
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.train.backends.torch.engine import TorchEngine
from areal_hpc.train.worker import TrainerHandlers
from areal_hpc.weights.group import GroupTimeout, WeightGroup, host_store
from areal_hpc.weights.publisher import BroadcastPublisher, WeightSyncError
from areal_hpc.weights.sender import WeightSender
from tests.test_gen_server import in_thread, wait_running

REPO = Path(__file__).resolve().parents[1]
TOKEN = "weights-test-token"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    """A built-in server subprocess on the tiny model (float32, CPU)."""
    run_dir = tmp_path_factory.mktemp("run")
    secret, address = run_dir / "secret", run_dir / "gen-0.json"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    cmd = [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", str(tiny_model_dir)]
    cmd += ["--token-file", str(secret), "--address-file", str(address), "--seed", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not address.exists():
        assert proc.poll() is None, f"server exited early:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "server did not write its address file"
        time.sleep(0.1)
    client = GenClient(json.loads(address.read_text())["url"], TOKEN, timeout=60)
    client.wait_healthy(timeout=30)
    yield client
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()


class LocalTrainer:
    """Trainer rank 0 in this process: the mailbox requests go straight to the real handlers."""

    def __init__(self, handlers: TrainerHandlers, send: bool = True):
        self.handlers, self.send, self.calls = handlers, send, []

    def call_each(self, type: str, payload=None, timeout: float | None = None) -> list:
        return [self.call_one(0, type, payload, timeout)]

    def call_one(self, rank: int, type: str, payload=None, timeout: float | None = None):
        assert rank == 0
        self.calls.append(type)
        if type == "broadcast_weights" and not self.send:
            time.sleep(timeout + 2)  # the trainer never sends
            raise TimeoutError("the test trainer did not send")
        return getattr(self.handlers, type)(payload)


def perturbed_trainer(model_dir: Path, seed: int) -> TrainerHandlers:
    """Trainer rank 0 whose actor's weights moved by random noise (the tied embedding too)."""
    cfg = ExperimentConfig()
    handlers = TrainerHandlers(cfg, rank=0, world_size=1)
    actor = TorchEngine(
        TrainedModelConfig(path=str(model_dir), dtype="float32", gradient_checkpointing=False)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    handlers.engines["actor"] = actor
    return handlers


def check_greedy_under(model: torch.nn.Module, out: dict) -> None:
    """The server's tokens are the model's greedy choices and its logprobs the model's."""
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    assert logits.argmax(-1).tolist() == out["output_ids"]
    expected = logits.log_softmax(-1).gather(-1, ids[0, len(PROMPT) :, None]).squeeze(-1)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4)


def test_broadcast_swaps_the_weights_between_steps_and_sets_the_version(client, tiny_model_dir):
    handlers = perturbed_trainer(tiny_model_dir, seed=0)
    before = client.generate(PROMPT, GREEDY)[0]
    # 64 KiB buckets: the tiny model (~800 KiB with the tied embedding sent twice) goes in several buckets,
    # and each 256 KiB embedding in one of its own.
    publisher = BroadcastPublisher(LocalTrainer(handlers), [client], timeout=60, bucket_bytes=64 * 1024)

    running, box = in_thread(client.generate, [2, 7, 1], LONG)
    wait_running(client)
    stats = publisher.publish(7)
    running.join(30)
    interrupted = box[0][0]
    assert interrupted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(interrupted["output_ids"]) < LONG["max_new_tokens"]  # partial output comes back

    sizes = {
        n: torch.Size(s) for b in publisher.buckets for n, s in zip(b["names"], b["shapes"], strict=True)
    }
    assert len(publisher.buckets) > 3 and "lm_head.weight" in sizes and "model.embed_tokens.weight" in sizes
    assert stats["weight_sync/bytes"] == sum(4 * s.numel() for s in sizes.values())
    assert stats["timeperf/weight_sync"] > 0 and stats["timeperf/weight_group_init"] > 0

    after = client.generate(PROMPT, GREEDY)[0]
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "7" and client.model_info()["weight_version"] == "7"
    check_greedy_under(handlers.engines["actor"].model, after)

    # The next version reuses the group: only the broadcast, no second setup.
    handlers.engines["actor"].model.model.norm.weight.data.mul_(0.5)
    stats = publisher.publish(8)
    assert "timeperf/weight_group_init" not in stats
    check_greedy_under(handlers.engines["actor"].model, client.generate(PROMPT, GREEDY)[0])
    assert client.model_info()["weight_version"] == "8"

    # A disk update makes the server a new model: the next broadcast lands in that one.
    client.update_weights_from_disk(str(tiny_model_dir), 9)
    handlers.engines["actor"].model.model.norm.weight.data.mul_(2.0)
    publisher.publish(10)
    check_greedy_under(handlers.engines["actor"].model, client.generate(PROMPT, GREEDY)[0])
    print(
        f"\ntiny model over gloo, {len(publisher.buckets)} buckets: {stats['timeperf/weight_sync'] * 1e3:.1f} ms"
    )


def test_without_interruption_generation_waits_in_place_for_every_bucket(client, tiny_model_dir):
    # interruptible_generation: false. The running answer is not cut: it pauses while the buckets arrive (no
    # half-updated model serves between two of them) and ends on the new weights under the one new version.
    handlers = perturbed_trainer(tiny_model_dir, seed=3)
    publisher = BroadcastPublisher(
        LocalTrainer(handlers), [client], timeout=60, bucket_bytes=64 * 1024, abort_all_requests=False
    )
    publisher.setup()
    running, box = in_thread(client.generate, [2, 7, 1], {**LONG, "max_new_tokens": 300})
    wait_running(client)
    publisher.publish(9)
    running.join(60)
    (answer,) = box[0]
    assert answer["meta_info"]["finish_reason"]["type"] == "length" and len(answer["output_ids"]) == 300
    assert answer["meta_info"]["weight_version"] == "9" and not client.server_info()["paused"]
    check_greedy_under(handlers.engines["actor"].model, client.generate(PROMPT, GREEDY)[0])


def test_a_sync_that_never_comes_times_out_and_the_server_still_serves(client, tiny_model_dir):
    trainer = LocalTrainer(perturbed_trainer(tiny_model_dir, seed=1), send=False)
    publisher = BroadcastPublisher(trainer, [client], timeout=3)
    version = client.model_info()["weight_version"]
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        publisher.publish(9)
    message = str(err.value)
    assert time.monotonic() - start < 15
    assert f"server 0 ({client.url})" in message and "timed out after 3 s" in message
    assert f"weight group '{publisher.group_name}'" in message and "1 peer(s)" in message
    assert "trainer rank 0" in message  # still running: named too
    assert trainer.calls == ["weight_group_store", "init_weight_group", "broadcast_weights"]

    assert client.health() and client.model_info()["weight_version"] == version
    client.continue_generation()  # the failed publish left generation paused
    assert client.generate(PROMPT, GREEDY)[0]["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(GenServerError, match="no weight update group"):  # the failed group was dropped
        client.destroy_weights_update_group(publisher.group_name)


def test_bad_requests_name_the_field_and_an_unknown_group_fails_cleanly(client):
    with pytest.raises(GenServerError, match="HTTP 400.*shapes") as err:
        client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[-1]])
    assert err.value.status == 400
    with pytest.raises(GenServerError, match="no weight update group 'nope'"):
        client.update_weights_from_distributed(
            ["lm_head.weight"], ["float32"], [[1024, 64]], group_name="nope"
        )
    with pytest.raises(GenServerError, match="master_port"):
        client._succeed("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1})
    with pytest.raises(GenServerError, match="HTTP 401"):
        GenClient(client.url, "wrong").destroy_weights_update_group("x")


def test_a_group_whose_peers_never_join_times_out_naming_it():
    start = time.monotonic()
    with pytest.raises(
        GroupTimeout,
        match=r"weight group 'lonely' \(gloo, rank 0 of 3\): not every one of the 3 ranks joined within 1 s",
    ):
        WeightGroup(host_store("127.0.0.1", 0, 1), "lonely", 0, 3, "gloo", timeout_s=1)
    assert time.monotonic() - start < 10


def test_a_node_name_that_resolves_to_loopback_here_is_served_on_every_interface(monkeypatch, caplog):
    """Debian's /etc/hosts maps the node's own name to 127.0.1.1: its peers resolve it to another address."""
    resolve = socket.getaddrinfo
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *a, **k: resolve("127.0.1.1" if host == "node7" else host, *a, **k),
    )
    sender = WeightSender()
    port = sender.open("bound", timeout_s=5, host="node7")
    try:
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
        assert "node7 resolves to 127.0.1.1 here" in caplog.text
    finally:
        sender.close()


def test_the_groups_store_listens_on_the_address_given_to_the_servers_alone():
    sender = WeightSender()
    port = sender.open("bound", timeout_s=5, host="127.0.0.1")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):  # another address of this machine
            socket.create_connection(("127.0.0.2", port), timeout=5)
    finally:
        sender.close()
