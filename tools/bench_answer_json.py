"""A rollout's answers on the wire: the built-in server's encoding and the client's parse of 16 answers of 8 x
1,024 tokens with logprobs (the issue-32 step's), json's against orjson's (what the server and client use).

    python tools/bench_answer_json.py [--answers 16] [--samples 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import orjson


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    answers = [answer(args.samples, args.tokens) for _ in range(args.answers)]
    wire = [json.dumps(a).encode() for a in answers]
    assert all(orjson.loads(orjson.dumps(a)) == a for a in answers)  # the same values either way
    baseline = best_ms(lambda: [json.dumps(a).encode() for a in answers]) + best_ms(
        lambda: [json.loads(w) for w in wire]
    )
    today = best_ms(lambda: [orjson.dumps(a) for a in answers]) + best_ms(
        lambda: [orjson.loads(w) for w in wire]
    )
    print(f"{args.answers} answers of {args.samples} x {args.tokens} tokens, encoded and parsed: "
          f"json {baseline:.1f} ms, orjson {today:.1f} ms: {baseline / today:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
