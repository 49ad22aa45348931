"""Admission: a process sends a server no more samples than it runs at once; the rest queue in the client,
where their HTTP timeouts do not run (issue 28)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_hpc.gen.client import Admission, GenClient, GenerationStopped

SERVICE_SECS = 0.5  # what one request takes once the stub runs it


class SlowServer(ThreadingHTTPServer):
    """Answers /generate as SGLang does when full: at most `capacity` samples run, each request takes
    SERVICE_SECS, the rest queue in the server."""

    daemon_threads = True

    def __init__(self, capacity: int):
        super().__init__(("127.0.0.1", 0), SlowHandler)
        self.capacity, self.running, self.most = capacity, 0, 0
        self.slots = threading.Semaphore(capacity)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def serve(self) -> None:
        with self.slots:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            time.sleep(SERVICE_SECS)
            with self.lock:
                self.running -= 1


class SlowHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.serve()
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "0", "output_token_logprobs": []}
        body = json.dumps([{"text": "", "output_ids": [], "meta_info": meta}]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002
        pass


@pytest.fixture
def server():
    httpd = SlowServer(capacity=2)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_requests_beyond_the_servers_capacity_wait_in_the_client_not_against_their_timeout(server):
    # 12 requests on 2 slots of 0.5 s queue for 3 s; a call may take 1.5 s. Sent all at once, the last ones
    # would time out in the server's queue (GenServerError); admitted two at a time, each takes 0.5 s.
    client = GenClient(server.url, None, timeout=1.5, capacity=2)
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: client.generate([1, 2, 3], {"n": 1}), range(12)))
    assert len(answers) == 12 and server.most == 2
    assert client.admission.in_use == client.admission.waiting == 0


def test_a_request_larger_than_the_capacity_waits_for_all_of_it_first_come_first_served():
    gate = Admission("http://server", capacity=4)
    order: list[str] = []

    def take(name: str, n: int) -> None:
        with gate.slots(n):
            order.append(name)

    with gate.slots(3):  # 3 of 4 slots busy
        big = threading.Thread(target=take, args=("16 samples", 16))
        big.start()
        wait_until(lambda: gate.waiting == 4)  # takes the whole capacity
        small = threading.Thread(target=take, args=("1 sample", 1))
        small.start()
        wait_until(lambda: gate.waiting == 5)
        time.sleep(0.2)
        assert order == []  # the one free slot does not let the later, smaller request overtake
    big.join(10)
    small.join(10)
    assert order == ["16 samples", "1 sample"] and gate.in_use == 0


def test_a_request_waiting_for_slots_is_given_up_when_its_caller_stops():
    gate = Admission("http://server", capacity=1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def wait_for_a_slot() -> None:
        try:
            with gate.slots(1, stop):
                pass
        except GenerationStopped as exc:
            errors.append(exc)

    with gate.slots(1):  # held until after the stop
        waiter = threading.Thread(target=wait_for_a_slot)
        waiter.start()
        wait_until(lambda: gate.waiting == 1)
        stop.set()
        waiter.join(10)
        assert not waiter.is_alive()
    (error,) = errors
    assert str(error) == "/generate to http://server not sent: stopped while waiting for 1 of its 1 slots"
    assert gate.waiting == gate.in_use == 0


def test_clients_of_one_server_share_its_admission():
    one, other = GenClient("http://gen:1", None, capacity=8), GenClient("http://gen:1/", None, capacity=8)
    assert one.admission is other.admission
    assert GenClient("http://gen:1", None).admission is None  # no capacity: no limit
    with pytest.raises(ValueError, match="http://gen:1 has a capacity of 8 samples in this process, not 4"):
        GenClient("http://gen:1", None, capacity=4)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
