"""Benchmark a generation server: generated tokens/s of N concurrent requests vs the same requests one at a time;
and the time of a small call (``/model_info``) on a kept connection vs on a new connection each time.

By default it starts the built-in server (a subprocess) on the tiny model and stops it afterwards; with
``--url`` and ``--token-file`` it measures a server that is already running (the built-in one or real SGLang).
Every request samples exactly ``--max-new-tokens`` tokens (ignore_eos), so both runs do the same work.

Usage::

    python tools/bench_gen.py [--model-path .cache/tiny/model] [--requests 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

from areal_hpc.gen.client import GenClient  # noqa: E402


@contextmanager
def builtin_server(args: argparse.Namespace) -> Iterator[GenClient]:
    """Start ``python -m areal_hpc.gen.backends.builtin.server`` with a fresh secret; yield a client; SIGTERM it at the end."""
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as run_dir:
        secret, address = Path(run_dir) / "secret", Path(run_dir) / "address.json"
        token = os.urandom(16).hex()
        secret.write_text(token)
        secret.chmod(0o600)
        cmd = [sys.executable, "-m", "areal_hpc.gen.backends.builtin.server", "--model-path", args.model_path]
        cmd += ["--token-file", str(secret), "--address-file", str(address), "--seed", "0"]
        cmd += ["--max-batch-size", str(args.max_batch_size), "--num-threads", str(args.num_threads)]
        cmd += ["--device", args.device]
        proc = subprocess.Popen(cmd, cwd=REPO)
        try:
            deadline = time.monotonic() + args.start_timeout
            while not address.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start within {args.start_timeout} s")
                time.sleep(0.1)
            client = GenClient(json.loads(address.read_text())["url"], token, timeout=args.timeout)
            client.wait_healthy(timeout=30)
            yield client
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids (not special tokens: ids from 16 up)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def one_at_a_time(client: GenClient, prompts: list[list[int]], params: dict) -> tuple[int, float]:
    """(generated tokens, seconds) of the prompts sent one after the other."""
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += sum(len(o["output_ids"]) for o in client.generate(prompt, params, return_logprob=True))
    return tokens, time.perf_counter() - start


def concurrent(client: GenClient, prompts: list[list[int]], params: dict) -> tuple[int, float]:
    """(generated tokens, seconds) of the prompts sent at once, one thread each."""
    counts = [0] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def send(i: int) -> None:
        barrier.wait()
        counts[i] = sum(
            len(o["output_ids"]) for o in client.generate(prompts[i], params, return_logprob=True)
        )

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(counts), time.perf_counter() - start


def call_ms(calls: int, client_of_call) -> float:
    """Median milliseconds of ``calls`` calls of /model_info, each through ``client_of_call()``."""
    times = []
    for _ in range(calls):
        client = client_of_call()
        start = time.perf_counter()
        client.model_info()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(client: GenClient, args: argparse.Namespace) -> dict:
    """Both measurements on one server, after a warm-up request."""
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = make_prompts(args.requests, args.prompt_len, args.vocab_size, args.seed)
    client.generate(prompts[0], {**params, "max_new_tokens": 4})
    seq_tokens, seq_s = one_at_a_time(client, prompts, params)
    conc_tokens, conc_s = concurrent(client, prompts, params)
    seq_tps, conc_tps = seq_tokens / seq_s, conc_tokens / conc_s
    # A new client has no connection yet: each of its calls connects, as every call did before keep-alive.
    fresh = call_ms(args.calls, lambda: GenClient(client.url, client.token, client.timeout))
    kept = call_ms(args.calls, lambda: client)
    return {
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "sequential_tokens_per_s": round(seq_tps, 1),
        "concurrent_tokens_per_s": round(conc_tps, 1),
        "speedup": round(conc_tps / seq_tps, 2),
        "max_requests_per_forward": client.server_info().get("stats", {}).get("max_requests_per_forward"),
        "call_ms_new_connection": round(fresh, 3),
        "call_ms_kept_connection": round(kept, 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=".cache/tiny/model", help="model of the built-in server")
    p.add_argument("--url", default=None, help="measure this running server instead of starting one")
    p.add_argument("--token-file", default=None, help="bearer token file of --url")
    p.add_argument("--requests", type=int, default=8, help="N: requests, sent concurrently or one by one")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn below this")
    p.add_argument("--max-batch-size", type=int, default=64, help="built-in server's --max-batch-size")
    p.add_argument("--num-threads", type=int, default=1, help="built-in server's torch CPU threads")
    p.add_argument("--device", default="cpu", help="built-in server's device")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--calls", type=int, default=300, help="timed /model_info calls of each kind")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP call")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the server to start")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark and print the two rates and their ratio."""
    args = parse_args(argv)
    if args.url:
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        result = bench(GenClient(args.url, token, timeout=args.timeout), args)
    else:
        with builtin_server(args) as client:
            result = bench(client, args)
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens: "
        f"one at a time {result['sequential_tokens_per_s']} tok/s, "
        f"concurrent {result['concurrent_tokens_per_s']} tok/s, "
        f"ratio {result['speedup']}x (max {result['max_requests_per_forward']} requests per forward pass)"
    )
    print(
        f"/model_info: {result['call_ms_kept_connection']} ms on a kept connection, "
        f"{result['call_ms_new_connection']} ms on a new one "
        f"({result['call_ms_new_connection'] / result['call_ms_kept_connection']:.2f}x)"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
