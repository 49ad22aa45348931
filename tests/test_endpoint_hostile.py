"""Hostile agents against a real endpoint and a real built-in server on the tiny model: whatever a request gets
wrong is a 4xx in OpenAI's shape (its episode counts it), an agent that gives up then drops its group as
`agent_error` (never a failure of the rollout role), and the next well-behaved group trains. Connections that
send nothing, or send slowly, lose their thread within seconds; past the cap a connection gets 503 at once."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import threading
import time
from contextlib import suppress
from urllib.parse import urlsplit

import openai
import pytest

from areal_hpc.agent import bounds
from areal_hpc.gen.agents import function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episodes import AgentFailed, run_group
from tests.test_episodes import PARAMS, RECORD, services

CONTEXT = 2048  # the tiny model's


@pytest.fixture
def endpoint():
    endpoint = Endpoint("policy", max_connections=8, read_secs=1.0)
    yield endpoint
    endpoint.shutdown()


@pytest.fixture
def svc(tiny_tokenizer):
    svc = services(tiny_tokenizer)
    svc.max_context = CONTEXT
    return svc


def post(base_url: str, key: str, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """One request on a connection of its own: its status and its JSON answer."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", f"/v1{path}", data, {"Authorization": f"Bearer {key}", **(headers or {})})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer


def sends(path: str, body, seen: list):
    """An agent that sends one request and, refused, gives up (as an SDK agent raises BadRequestError)."""

    async def agent(
        base_url, api_key, record
    ):  # blocking calls off the episode's event loop, which serves them
        status, answer = await asyncio.to_thread(post, base_url, api_key, path, body)
        seen.append((status, answer.get("error", {})))
        if status != 200:
            raise RuntimeError(answer["error"]["message"])
        return 1.0

    return agent


async def well_behaved(base_url, api_key, record):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": record.prompt}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 1.0


def dropped_then_next_trains(agent, client, svc, endpoint) -> None:
    """The agent's group is dropped as agent_error, and a well-behaved group after it trains."""
    with pytest.raises(AgentFailed) as caught:
        run_group(svc, function_agent(agent, endpoint), client, RECORD, PARAMS, 1, 60)
    assert caught.value.reason == "agent_error"
    result = run_group(svc, function_agent(well_behaved, endpoint), client, RECORD, PARAMS, 2, 60)
    assert result.rewards == [1.0, 1.0] and result.counts["turns"] == 2


def chat(content) -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", {"model": "policy", "prompt": [3000000000]}, "prompt[0]"),  # past int32
        ("/completions", {"model": "policy", "prompt": [1, 5000]}, "prompt[1]"),  # past the vocabulary
        ("/chat/completions", chat("hi \ud800"), "messages[0].content"),  # a lone surrogate
        ("/chat/completions", chat([{"type": "text", "text": "\udfff"}]), "messages[0].content[0].text"),
    ],
)
def test_ids_and_text_no_server_can_take_are_the_agent_s_error(
    builtin_client, svc, endpoint, path, body, param
):
    seen = []
    dropped_then_next_trains(sends(path, body, seen), builtin_client, svc, endpoint)
    [(status, error)] = seen
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param


def test_nesting_deeper_than_the_bound_is_refused_and_nested_text_stays_text(builtin_client, svc, endpoint):
    deep: dict | list = {}
    for _ in range(900):
        deep = [deep]
    call = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": {"x": deep}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c0", "content": "4"}]  # fmt: skip
    seen = []
    agent = sends("/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 2}, seen)
    dropped_then_next_trains(agent, builtin_client, svc, endpoint)
    [(status, error)] = seen
    assert status == 400 and "nested deeper than 32" in error["message"]
    # Nested as JSON text, as the SDK sends arguments: it stays the text it is, is rendered and served.
    call["function"]["arguments"] = json.dumps({"x": deep})
    agent = sends("/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 2}, seen)
    result = run_group(svc, function_agent(agent, endpoint), builtin_client, RECORD, PARAMS, 1, 60)
    assert result.rewards == [1.0] and seen[-1][0] == 200


def test_a_server_s_refusal_of_what_the_agent_asked_is_the_agent_s_error(builtin_client, svc, endpoint):
    svc.vocab_size = 10**6  # the endpoint lets id 5000 through: the built-in server refuses it (400)
    seen = []
    agent = sends("/completions", {"model": "policy", "prompt": [5000]}, seen)
    dropped_then_next_trains(agent, builtin_client, svc, endpoint)
    [(status, error)] = seen
    assert status == 400 and "generation server refused" in error["message"]


def test_a_huge_message_is_refused_by_its_length_before_it_is_rendered(builtin_client, svc, endpoint):
    answers = []

    async def announces_8_mib(base_url, api_key, record):
        headers = {"Authorization": f"Bearer {api_key}", "Content-Length": 8 * 2**20}
        answers.append(await asyncio.to_thread(raw, endpoint, request("/chat/completions", headers)))
        raise RuntimeError("refused")

    dropped_then_next_trains(announces_8_mib, builtin_client, svc, endpoint)
    assert answers[0].startswith(b"HTTP/1.1 413")  # past the body's bound: refused before it is sent
    seen = []
    start = time.monotonic()  # under the body's bound, more text than the context holds: refused unrendered
    run = sends("/chat/completions", chat("x" * (bounds.BYTES_PER_TOKEN * CONTEXT + 1)), seen)
    dropped_then_next_trains(run, builtin_client, svc, endpoint)
    [(status, error)] = seen
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert time.monotonic() - start < 10  # an 8 MiB message took 19 s to render and tokenize


# --- the wire: framing, keys, slow and idle connections -----------------------------------------------------


def address(endpoint: Endpoint) -> tuple[str, int]:
    url = urlsplit(endpoint.base_url)
    return url.hostname, url.port


def raw(endpoint: Endpoint, data: bytes, timeout: float = 10) -> bytes:
    """What the endpoint answers to ``data`` sent on a new connection, up to its close."""
    with socket.create_connection(address(endpoint), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def request(path: str, headers: dict, body: bytes = b"") -> bytes:
    lines = [f"POST /v1{path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_the_key_is_checked_before_the_body_is_read(endpoint):
    # 300 MiB announced under a wrong key, none of it sent: refused at once (the body used to be read first).
    headers = {"Authorization": "Bearer wrong", "Content-Length": 300 * 2**20}
    answer = raw(endpoint, request("/chat/completions", headers), timeout=5)
    assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_body_of_no_stated_length_is_refused_unread(builtin_client, svc, endpoint):
    # The review's: Content-Length -1 and 300 MiB sent took the endpoint from 0.3 to 0.9 GB (rfile.read(-1)).
    seen = {}

    def flood(api_key: str) -> None:
        before = rss_mb()
        head = request("/chat/completions", {"Authorization": f"Bearer {api_key}", "Content-Length": -1})
        with socket.create_connection(address(endpoint), timeout=10) as sock:
            sock.sendall(head + b"{" * 65536)
            seen["answer"] = sock.recv(65536)
            with suppress(OSError):  # the endpoint has closed: the rest is refused by the kernel
                for _ in range(299):
                    sock.sendall(b"x" * 2**20)
        seen["grew"] = rss_mb() - before

    async def agent(base_url, api_key, record):
        await asyncio.to_thread(flood, api_key)
        return 1.0

    result = run_group(svc, function_agent(agent, endpoint), builtin_client, RECORD, PARAMS, 1, 60)
    assert result.rewards == [1.0] and result.counts["refused_requests"] == 1
    assert seen["answer"].startswith(b"HTTP/1.1 400") and b"Content-Length" in seen["answer"]
    assert seen["grew"] < 100, seen


def test_bad_framing_is_a_4xx_and_a_chunked_body_keeps_the_connection_in_step(builtin_client, svc, endpoint):
    seen = {}

    def framing(api_key: str) -> None:
        good = json.dumps(chat("hi")).encode()
        auth = {"Authorization": f"Bearer {api_key}"}
        seen["no bearer"] = raw(
            endpoint,
            request("/chat/completions", {"Authorization": api_key, "Content-Length": len(good)}, good),
        )
        for name, length in (("negative", "-1"), ("not a number", "abc"), ("two", None)):
            headers = {**auth, "Content-Length": length or len(good)}
            data = request("/chat/completions", headers, good)
            if length is None:  # two lengths that disagree: which bytes are the next request?
                data = data.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(good) - 5}\r\n\r\n".encode(), 1)
            seen[name] = raw(endpoint, data + b"x" * 2**20)
        chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (good[:7], good[7:]))
        then = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + api_key.encode()
        then += b"\r\nConnection: close\r\n\r\n"
        seen["chunked"] = raw(
            endpoint,
            request("/chat/completions", {**auth, "Transfer-Encoding": "chunked"}, chunked + b"0\r\n\r\n")
            + then,
        )

    async def agent(base_url, api_key, record):
        await asyncio.to_thread(framing, api_key)
        return 1.0

    result = run_group(svc, function_agent(agent, endpoint), builtin_client, RECORD, PARAMS, 1, 60)
    # Three refusals counted for the episode; the key-less request is no episode's.
    assert result.rewards == [1.0] and result.counts["refused_requests"] == 3
    assert seen["no bearer"].startswith(b"HTTP/1.1 401")
    for name in ("negative", "not a number", "two"):
        assert seen[name].startswith(b"HTTP/1.1 400") and b"Content-Length" in seen[name], name
    # The chunked chat is served and the next request on the connection is read as one (the models list).
    first, second = seen["chunked"].split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and b"chat.completion" in first
    assert second.startswith(b"200") and b'"object": "list"' in second


def test_idle_and_slow_connections_lose_their_thread_and_past_the_cap_get_503(builtin_client, svc):
    # The review's: 150 connections that send nothing, under 120 threads (they used to hold 119 for good).
    endpoint = Endpoint("policy", max_connections=120, read_secs=1.0)
    try:
        threads = threading.active_count()
        idle = [socket.create_connection(address(endpoint), timeout=10) for _ in range(150)]
        idle[0].sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # a slow one: and never the rest
        start = time.monotonic()
        answers = [sock.recv(65536) for sock in idle]  # each closed by the endpoint: at once past the cap
        assert time.monotonic() - start < 5
        assert answers.count(b"") == 120 and all(b"too_many_connections" in a for a in answers if a)
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers if a)
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 5
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= threads
        result = run_group(svc, function_agent(well_behaved, endpoint), builtin_client, RECORD, PARAMS, 4, 60)
        assert result.rewards == [1.0] * 4
    finally:
        endpoint.shutdown()
