"""The built-in generation server as a real subprocess, driven by GenClient over SGLang's HTTP API."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.control.manifest import write_manifest
from areal_hpc.gen.backends.builtin.server import ServerSetupError, main, read_token
from areal_hpc.gen.client import GenClient, GenServerError
from areal_hpc.weights.shared import SharedWeights

REPO = Path(__file__).resolve().parents[1]
TOKEN = "test-secret-token"
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A server subprocess on the tiny model; on teardown SIGTERM must stop it cleanly."""
    run_dir = tmp_path_factory.mktemp("run")
    secret, address = run_dir / "secret", run_dir / "gen-0.json"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    cmd = [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", str(tiny_model_dir)]
    cmd += [
        "--token-file",
        str(secret),
        "--address-file",
        str(address),
        "--seed",
        "1",
        "--max-batch-size",
        "16",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while not address.exists():
        assert proc.poll() is None, f"server exited early:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "server did not write its address file"
        time.sleep(0.1)
    yield proc, json.loads(address.read_text()), address
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    assert not address.exists(), "a clean shutdown removes the address file"


@pytest.fixture(scope="module")
def client(server) -> GenClient:
    client = GenClient(server[1]["url"], TOKEN, timeout=60)
    client.wait_healthy(timeout=30)
    return client


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def wait_for(condition, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def wait_running(client: GenClient) -> None:
    """Until a request runs and has generated a few tokens."""
    start = client.server_info()["stats"].get("generated_tokens", 0)
    wait_for(lambda: (info := client.server_info())["num_running_reqs"] == 1
             and info["stats"]["generated_tokens"] > start + 3)  # fmt: skip


def test_address_file_and_info(server, client):
    proc, address, _ = server
    assert address["pid"] == proc.pid and address["url"].startswith("http://127.0.0.1:")
    info = client.model_info()
    assert info["is_generation"] and info["weight_version"] == "0"
    assert Path(info["model_path"]).name == "model" and info["tokenizer_path"] == info["model_path"]
    assert client.server_info()["max_running_requests"] == 16
    assert (
        client.server_info()["gc"]["frozen_objects"] > 10_000
    )  # torch's and the model's, never scanned again


def test_generate_from_input_ids_and_from_text(client, tiny_tokenizer):
    text = "What is 3 + 4?"
    by_text = client.generate(None, GREEDY, text=text)
    by_ids = client.generate(tiny_tokenizer(text)["input_ids"], GREEDY)
    assert len(by_text) == len(by_ids) == 1 and by_text[0]["output_ids"] == by_ids[0]["output_ids"]
    out = by_ids[0]
    meta = out["meta_info"]
    assert out["text"] == tiny_tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["prompt_tokens"] == len(tiny_tokenizer(text)["input_ids"]) and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]


def test_n_samples_of_a_list_of_prompts_come_prompt_major(client):
    params = {"max_new_tokens": 3, "n": 3, "temperature": 1.0}
    outs = client.generate([[5, 6], [7, 8, 9, 10]], params, return_logprob=False, rid="batch")
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 2, 2, 4, 4, 4]
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    assert [o["meta_info"]["id"] for o in outs] == [f"batch-{k}" for k in range(6)]


def test_finish_reason_stop_on_a_stop_token(client):
    greedy = client.generate([11, 12, 13], GREEDY)[0]["output_ids"]
    out = client.generate([11, 12, 13], {**GREEDY, "stop_token_ids": [greedy[2]]})[0]
    assert out["output_ids"] == greedy[: greedy.index(greedy[2]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy[2]}


def test_logprobs_equal_a_forward_pass_at_the_same_temperature(client, model):
    prompt, temperature = [4, 8, 15, 16, 23, 42], 0.7
    params = {"max_new_tokens": 8, "n": 2, "temperature": temperature, "top_k": 50, "ignore_eos": True}
    for out in client.generate(prompt, params):
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
        expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4)


def test_concurrent_requests_share_batches_and_match_one_at_a_time(client):
    prompts = [[5, 6, 7], [100, 200, 300, 400, 500], [9], [60, 61, 62, 63]]
    alone = [client.generate(p, GREEDY)[0]["output_ids"] for p in prompts]
    before = client.server_info()["stats"]
    client.pause_generation()  # queue all four, then release them together
    threads = [in_thread(client.generate, p, GREEDY) for p in prompts]
    wait_for(lambda: client.server_info()["num_queued_reqs"] == 4)
    client.continue_generation()
    for thread, _ in threads:
        thread.join(60)
    assert [box[0][0]["output_ids"] for _, box in threads] == alone
    stats = client.server_info()["stats"]
    assert stats["prefill_passes"] - before["prefill_passes"] == 1  # one shared prefill
    assert stats["decode_steps"] - before["decode_steps"] == GREEDY["max_new_tokens"] - 1
    assert stats["max_requests_per_forward"] >= 4


def test_abort_returns_partial_output(client):
    thread, box = in_thread(client.generate, [1, 2, 3], LONG, rid="to-abort")
    wait_running(client)
    assert client.abort_request("to-abort")["aborted"] == 1
    thread.join(30)
    out = box[0][0]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "to-abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(client):
    running, first = in_thread(client.generate, [1, 2, 3], LONG)
    wait_running(client)
    assert client.pause_generation()["aborted"] == 1
    running.join(30)
    assert first[0][0]["meta_info"]["finish_reason"]["type"] == "abort"
    held, second = in_thread(client.generate, [4, 5], GREEDY)
    wait_for(lambda: client.server_info()["num_queued_reqs"] == 1)
    time.sleep(0.3)
    assert held.is_alive() and client.server_info()["paused"]
    client.continue_generation()
    held.join(30)
    assert second[0][0]["meta_info"]["finish_reason"]["type"] == "length"


def test_update_weights_from_disk_changes_outputs_and_version(client, model, tiny_model_dir, tmp_path):
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    perturbed.save_pretrained(tmp_path / "v5")
    write_manifest(tmp_path / "v5")  # a snapshot is complete once its manifest is there
    original = shutil.copytree(tiny_model_dir, tmp_path / "original")
    write_manifest(original)
    before = client.generate([3, 1, 4, 1, 5], GREEDY)[0]

    running, box = in_thread(client.generate, [2, 7, 1], LONG)
    wait_running(client)
    result = client.update_weights_from_disk(str(tmp_path / "v5"), weight_version=5)
    running.join(30)
    assert result["success"] and box[0][0]["meta_info"]["finish_reason"]["type"] == "abort"
    after = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "5"
    assert client.model_info()["weight_version"] == "5"

    with pytest.raises(GenServerError, match=r"HTTP 400.*failed to load weights"):
        client.update_weights_from_disk(str(tmp_path / "missing"), weight_version=6)
    client.update_weights_from_disk(str(original), weight_version=6)
    again = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
    assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == "6"


def test_update_weights_from_tensor_copies_what_this_process_shares(client, model):
    """The trainer's colocated path (weight_update_mode tensor): the server maps this process's shared memory."""
    before = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
    gen = torch.Generator().manual_seed(1)
    perturbed = [(n, p.detach() + torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]
    weights = SharedWeights()
    result = client.update_weights_from_tensor([weights.share(perturbed)["serialized"]], weight_version=7)
    assert result["success"]
    after = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "7"

    bad = base64.b64encode(pickle.dumps(os.getcwd)).decode()  # a payload naming a function to run
    with pytest.raises(GenServerError, match="refused: the payload names posix.getcwd"):
        client.update_weights_from_tensor([bad])
    wrong = [(n, t[..., :1]) if t.dim() == 2 else (n, t) for n, t in perturbed]
    with pytest.raises(GenServerError, match=r"shape \(\d+, 1\), the model's is"):
        client.update_weights_from_tensor([weights.share(wrong)["serialized"]])
    original = [(n, p.detach()) for n, p in model.named_parameters()]
    client.update_weights_from_tensor([weights.share(original)["serialized"]], weight_version=8)
    weights.release()
    assert client.generate([3, 1, 4, 1, 5], GREEDY)[0]["output_ids"] == before["output_ids"]


def test_released_memory_serves_nothing_until_resumed_and_updated(client, tiny_model_dir):
    """Colocated turns (master/turns.py): release while idle, resume the weights, update them, resume the rest."""
    before = client.generate([3, 1, 4, 1, 5], GREEDY)[0]
    held = client.server_info()["memory"]["weights_bytes"]
    running, _ = in_thread(client.generate, [2, 7, 1], LONG)
    wait_running(client)
    with pytest.raises(GenServerError, match="HTTP 400.*needs an idle server"):
        client.release_memory_occupation()
    client.abort_request(abort_all=True)
    running.join(30)

    client.release_memory_occupation()
    memory = client.server_info()["memory"]
    assert memory == {
        "released": ["cuda_graph", "kv_cache", "weights"],
        "weights_stale": False,
        "weights_bytes": 0,
    }
    with pytest.raises(GenServerError, match="HTTP 400.*kv_cache, weights memory is released"):
        client.generate([3, 1, 4, 1, 5], GREEDY)
    with pytest.raises(GenServerError, match="HTTP 400.*resume_memory_occupation first"):
        client.update_weights_from_disk(str(tiny_model_dir))
    client.resume_memory_occupation(["weights"])
    memory = client.server_info()["memory"]
    assert (
        memory["weights_bytes"] == held
        and memory["weights_stale"]
        and memory["released"] == ["cuda_graph", "kv_cache"]
    )
    with pytest.raises(GenServerError, match="HTTP 400.*tags.*'weights'"):
        client.resume_memory_occupation(["weights"])  # not released
    client.update_weights_from_disk(str(tiny_model_dir))
    client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert client.server_info()["memory"]["released"] == []
    assert client.generate([3, 1, 4, 1, 5], GREEDY)[0]["output_ids"] == before["output_ids"]


def test_every_route_but_health_needs_the_token(client):
    for token in (None, "wrong-token"):
        other = GenClient(client.url, token, timeout=10)
        assert other.health()
        for call in (other.model_info, other.server_info, lambda c=other: c.generate([1], GREEDY)):
            with pytest.raises(GenServerError, match="HTTP 401") as err:
                call()
            assert err.value.status == 401


def post_raw(client: GenClient, route: str, data: bytes) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    request = urllib.request.Request(client.url + route, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", None),
        (b'{"sampling_params": {"max_new_tokens": 2}}', "input_ids"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "sampling_params.temperature"),
        (
            b'{"input_ids": [1], "sampling_params": {"frequency_penalty": 1}}',
            "sampling_params.frequency_penalty",
        ),
        (b'{"input_ids": [1], "stream": true}', "stream"),
        (b'{"input_ids": "abc"}', "input_ids"),
    ],
)
def test_bad_requests_answer_400_naming_the_field(client, body, field):
    status, answer = post_raw(client, "/generate", body)
    assert status == 400 and answer["error"]["field"] == field
    assert (field or "not valid JSON") in answer["error"]["message"]


def test_unknown_route_and_missing_rid(client):
    assert post_raw(client, "/nope", b"{}")[0] == 404
    status, answer = post_raw(client, "/abort_request", b"{}")
    assert status == 400 and answer["error"]["field"] == "rid"
    assert client.flush_cache() is None


def test_token_file_must_be_private(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("abc\n")
    secret.chmod(0o644)
    with pytest.raises(ServerSetupError, match=r"mode 0644.*chmod 600"):
        read_token(secret)
    with pytest.raises(SystemExit, match="must not be accessible by group or others"):
        main(["--model-path", "unused", "--token-file", str(secret)])
    secret.chmod(0o600)
    assert read_token(secret) == "abc"
    os.chmod(secret, 0o640)
    with pytest.raises(ServerSetupError):
        read_token(secret)


def test_a_failed_update_without_abort_leaves_the_server_serving(client, tmp_path):
    with pytest.raises(GenServerError, match="HTTP 400"):
        client.update_weights_from_disk(str(tmp_path / "missing"), abort_all_requests=False)
    # It used to admit nothing more after such a failure while /health said 200: every /generate hung.
    assert client.generate([3, 1, 4], GREEDY, timeout=30)[0]["output_ids"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
        ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                              "shapes": [[1, 1]], "group_name": "nope"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}),
    ],
)  # fmt: skip
def test_a_weight_update_without_abort_all_requests_lets_running_answers_finish_first(client, route, body):
    # SGLang's default on all three routes. The update fails here (no such snapshot, group or payload), but
    # only after the running answer ended: the server waited for it.
    running, box = in_thread(client.generate, [2, 7, 1], {**LONG, "max_new_tokens": 300})
    wait_running(client)
    status, _ = post_raw(client, route, json.dumps(body).encode())
    assert status == 400 and client.server_info()["num_running_reqs"] == 0
    running.join(30)
    assert box[0][0]["meta_info"]["finish_reason"]["type"] == "length"


def test_it_accepts_what_sglang_accepts(client, tiny_model_dir, tmp_path):
    # AReaL-lite's generate body as it sends it: image_data, neutral penalties.
    status, answer = post_raw(client, "/generate", json.dumps({
        "input_ids": [3, 1, 4], "image_data": None, "return_logprob": True, "stream": False,
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 100000000,
                            "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0},
    }).encode())  # fmt: skip
    assert status == 200 and len(answer["output_ids"]) <= 4
    status, answer = post_raw(client, "/generate", b'{"input_ids": [1], "sampling_params": {"min_p": 0.1}}')
    assert status == 400 and answer["error"]["field"] == "sampling_params.min_p"  # not neutral: refused
    # /health_generate needs no key; an update without a version keeps the server's.
    assert GenClient(client.url, None)._call("GET", "/health_generate", None) in (None, {})
    version = client.model_info()["weight_version"]
    plain = shutil.copytree(tiny_model_dir, tmp_path / "plain")  # a plain HF directory: no manifest
    assert client.update_weights_from_disk(str(plain))["weight_version"] == version


def test_master_port_may_come_as_a_string(client):
    # AReaL-lite sends it so; the join itself fails here (nobody serves the store), after the body is taken.
    status, answer = post_raw(client, "/init_weights_update_group", json.dumps({
        "master_address": "127.0.0.1", "master_port": "1", "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "gloo", "timeout_secs": 1,
    }).encode())  # fmt: skip
    assert status == 400 and "failed to join weight update group 'g'" in answer["message"]


@contextlib.contextmanager
def canned_server(bodies):
    """The URL of a server that answers each request (GET or POST) with the next of ``bodies``, status 200."""
    replies = iter(bodies)

    class Canned(BaseHTTPRequestHandler):
        def do_GET(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            reply = next(replies)
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_the_client_decodes_answers_that_come_without_text(tiny_tokenizer):
    # SGLang launched with --skip-tokenizer-init (as AReaL launches it) sends no text: this is its answer.
    ids = tiny_tokenizer.encode("7 + 1 = 8")
    meta = {"finish_reason": {"type": "length", "length": len(ids)}, "weight_version": "0",
            "prompt_tokens": 2, "completion_tokens": len(ids)}  # fmt: skip
    reply = json.dumps({"output_ids": ids, "meta_info": meta}).encode()
    with canned_server([reply]) as url:
        (answer,) = GenClient(url, None, tokenizer=tiny_tokenizer).generate([1, 2], {"max_new_tokens": 8})
    assert answer["text"] == tiny_tokenizer.decode(ids, skip_special_tokens=True) and answer["text"]


def test_an_answer_that_is_not_json_reaches_the_caller_as_its_text():
    """A server's body that no parser takes (invalid UTF-8, arrays nested past any decoder's depth, plain
    text): the call returns it as a message instead of failing inside the parser."""
    bodies = [b"\xff\xfe not text", b"[" * 100_000 + b"]" * 100_000, b"Internal Server Error"]
    with canned_server(bodies) as url:
        client = GenClient(url, None)
        answers = [client.model_info() for _ in bodies]
    assert [set(a) for a in answers] == [{"message"}] * 3
    assert answers[2]["message"] == "Internal Server Error"


def test_the_server_keeps_a_connection_open_between_requests(client):
    conn = http.client.HTTPConnection(urlsplit(client.url).hostname, urlsplit(client.url).port, timeout=10)
    for _ in range(3):  # a publication sends a request per bucket: no new connection for each
        conn.request("GET", "/model_info", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["weight_version"]
        assert not response.will_close
    conn.request("POST", "/no_such_route", body=b'{"left": "unread"}')  # the server ends the connection
    response = conn.getresponse()
    assert response.status == 404 and response.will_close
    conn.close()


def test_the_client_keeps_its_connection_and_replaces_one_closed_while_idle():
    connections, close_now = [], threading.Event()

    class ClosesWhenTold(BaseHTTPRequestHandler):  # as uvicorn closes a connection idle for 5 s: no word
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            connections.append(self.client_address)
            reply = json.dumps({"calls": len(connections)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
            self.close_connection = close_now.is_set()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ClosesWhenTold)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", None)
        assert [client.model_info()["calls"] for _ in range(3)] == [1, 2, 3]
        assert len(set(connections)) == 1
        close_now.set()
        assert client.model_info()["calls"] == 4  # answered, then the server hangs up
        close_now.clear()
        assert client.model_info()["calls"] == 5  # sent again on a new connection
        assert len(set(connections)) == 2
    finally:
        httpd.shutdown()
