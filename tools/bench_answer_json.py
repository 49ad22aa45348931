"""A rollout's answers on the wire: the built-in server's encoding and the client's parse of 16 answers of 8 x
1,024 tokens with logprobs (the issue-32 step's), json's against orjson's (what the server and client use); and
the garbage collections that formatting five rollouts' answers causes beside 60k live objects, per-token lists
(as before) against the server's format_output (tuples, which the collector stops tracking).

    python tools/bench_answer_json.py [--answers 16] [--samples 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_hpc.gen.backends.builtin.protocol import format_output  # noqa: E402


def answer(samples: int, tokens: int) -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(samples):
        ids = [rng.randrange(151936) for _ in range(tokens)]
        logprobs = [[rng.uniform(-8, 0), i, None] for i in ids]
        out.append(
            {"text": "x" * 4 * tokens, "output_ids": ids, "meta_info": {"output_token_logprobs": logprobs}}
        )
    return out


def best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def collections(format_one, outputs, rollouts: int = 5) -> tuple[int, float]:
    """Full collections, and their milliseconds, while ``rollouts`` rollouts' answers are formatted and held."""
    live = [{"a": [i]} for i in range(60_000)]  # a server's objects made since its freeze
    full, started = [0, 0.0], [0.0]

    def count(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            full[0] += 1
            full[1] += time.perf_counter() - started[0]

    gc.collect()
    gc.callbacks.append(count)
    try:
        for _ in range(rollouts):
            answers = [format_one(out) for out in outputs]
            del answers
    finally:
        gc.callbacks.remove(count)
    del live
    return full[0], full[1] * 1e3


def wire_ms(answers: list[list[dict]]) -> tuple[float, float]:
    """Milliseconds to encode and parse the answers: json's, orjson's."""
    wire = [json.dumps(a).encode() for a in answers]
    assert all(orjson.loads(orjson.dumps(a)) == a for a in answers)  # the same values either way
    baseline = best_ms(lambda: [json.dumps(a).encode() for a in answers])
    today = best_ms(lambda: [orjson.dumps(a) for a in answers])
    return baseline + best_ms(lambda: [json.loads(w) for w in wire]), today + best_ms(
        lambda: [orjson.loads(w) for w in wire]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    rng = random.Random(1)
    outputs = [
        SimpleNamespace(rid="r", finish_reason={"type": "length"}, skip_special_tokens=True, prompt_tokens=256,
                        cached_tokens=0, weight_version="1", latency=1.0, routed_experts=None,
                        output_ids=[rng.randrange(151936) for _ in range(args.tokens)],
                        logprobs=[rng.uniform(-8, 0) for _ in range(args.tokens)])
        for _ in range(args.answers * args.samples)
    ]  # fmt: skip
    lists = collections(
        lambda o: [[lp, t, None] for lp, t in zip(o.logprobs, o.output_ids, strict=True)], outputs
    )
    tuples = collections(lambda o: format_output(o, None, True, False), outputs)
    print(f"5 rollouts formatted: full collections {lists[0]} ({lists[1]:.1f} ms) with per-token lists, "
          f"{tuples[0]} ({tuples[1]:.1f} ms) with format_output's tuples")  # fmt: skip
    baseline, today = wire_ms([answer(args.samples, args.tokens) for _ in range(args.answers)])
    print(f"{args.answers} answers of {args.samples} x {args.tokens} tokens, encoded and parsed: "
          f"json {baseline:.1f} ms, orjson {today:.1f} ms: {baseline / today:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
