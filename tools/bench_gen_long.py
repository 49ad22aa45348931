"""Benchmark the built-in engine at reasoning lengths (issue 45): long-tailed answers and multi-turn episodes,
against a baseline copy of the engine in the same run.

``long``: 32 prompts x 8 answers, prompts of 200-1,000 tokens, each answer's length drawn from a lognormal
(median ``--median``, sigma ``--sigma``) clipped at ``--tail`` (ignore_eos, so random weights reach it). Every
answer is its own request (the 8 of a prompt share it). Reports generated tokens/s and whether any answer was
cut. The baseline's slots are sized so that none is cut: as many rows as its memory holds at prompt + tail.

``episodes``: ``--episodes`` concurrent episodes of ``--turns`` turns: a ``--first``-token prompt, each turn
``--turn-tokens`` sampled then ``--tool-tokens`` appended (a tool's answer), the next turn's prompt being the
whole conversation. Reports episodes/s and prefilled tokens per episode against the tokens it adds (prompt,
tool answers and model turns).

Usage (GPU; see tools/bench_gen.py for the baseline copy)::

    python tools/bench_gen_long.py --device cuda --mode long --shape 7b --baseline DIR
    python tools/bench_gen_long.py --device cuda --mode episodes --shape 1.5b --baseline DIR
    python tools/bench_gen_long.py --model-path .cache/tiny/model --mode long --prompts 4 --median 40 \\
        --tail 80 --min-prompt 8 --max-prompt 32 --baseline DIR     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gen import SHAPES, build_model, engine_classes, free_memory, log  # noqa: E402

RESERVED = 3 << 30  # the baseline engine's own reserve (its cache.py)


def long_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, answer length) of every answer: 8 per prompt."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(16, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(8):
            length = int(math.exp(rng.gauss(math.log(args.median), args.sigma)))
            out.append((prompt, max(1, min(length, args.tail))))
    return out


def run_long(engine, params_cls, work: list[tuple[list[int], int]], timeout: float) -> dict:
    """Generate ``work``; an engine not done after ``timeout`` s gets a bound instead: tokens/s below the
    workload's tokens over the time it had (it had not made them all by then)."""
    before = dict(engine.info()["stats"])
    start = time.perf_counter()
    requests = [
        engine.submit([p], params_cls(max_new_tokens=n, temperature=1.0, ignore_eos=True)) for p, n in work
    ]
    try:
        outputs = [r.wait(max(0.0, start + timeout - time.perf_counter()))[0] for r in requests]
    except TimeoutError:
        total = sum(n for _, n in work)
        return {"done": False, "wall_s": round(timeout, 1), "tokens_per_s": round(total / timeout, 1)}
    wall = time.perf_counter() - start
    after = engine.info()["stats"]
    tokens = sum(len(o.output_ids) for o in outputs)
    cut = sum(len(o.output_ids) != n for o, (_, n) in zip(outputs, work, strict=True))
    return {
        "done": True, "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1), "cut": cut,
        "max_batch_rows": after.get("max_batch_rows"),
        "retracted_rows": after.get("retracted_rows", 0) - before.get("retracted_rows", 0),
        "decode_steps": after["decode_steps"] - before["decode_steps"],
    }  # fmt: skip


def run_episodes(engine, params_cls, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)
    firsts = [[rng.randrange(16, vocab) for _ in range(args.first)] for _ in range(args.episodes)]
    tools = [[[rng.randrange(16, vocab) for _ in range(args.tool_tokens)] for _ in range(args.turns)]
             for _ in range(args.episodes)]  # fmt: skip
    params = params_cls(max_new_tokens=args.turn_tokens, temperature=1.0, ignore_eos=True)
    errors: list[BaseException] = []

    def episode(i: int) -> None:
        try:
            context = list(firsts[i])
            for turn in range(args.turns):
                out = engine.submit([context], params).wait(args.timeout)[0]
                context += out.output_ids + (tools[i][turn] if turn + 1 < args.turns else [])
        except BaseException as exc:  # reported below
            errors.append(exc)

    before = dict(engine.info()["stats"])
    start = time.perf_counter()
    threads = [threading.Thread(target=episode, args=(i,)) for i in range(args.episodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    after = engine.info()["stats"]
    added = args.first + args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    # Without reuse, turn t prefills the whole conversation so far: the baseline's count.
    full = sum(args.first + t * (args.turn_tokens + args.tool_tokens) for t in range(args.turns))
    prefilled = after.get("prefill_tokens", 0) - before.get("prefill_tokens", 0)
    return {
        "wall_s": round(wall, 2), "episodes_per_s": round(args.episodes / wall, 3),
        "tokens_added_per_episode": added, "full_prefill_per_episode": full,
        "prefilled_per_episode": round(prefilled / args.episodes, 1) if prefilled else None,
        "prefill_ratio": round(prefilled / args.episodes / added, 3) if prefilled else None,
        "prefill_s": round(after.get("prefill_secs", 0) - before.get("prefill_secs", 0), 2),
        "cached_tokens": after.get("cached_tokens", 0) - before.get("cached_tokens", 0),
    }  # fmt: skip


def baseline_rows(path: str, args: argparse.Namespace, context: int) -> int:
    """How many slots of ``context`` positions the baseline's memory holds (its slot_len arithmetic)."""
    config = json.loads((Path(path) / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 2
    per_token *= config["hidden_size"] // config["num_attention_heads"]
    if args.device == "cpu":
        return args.max_batch
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    free, total = torch.cuda.mem_get_info()
    budget = min(int(args.mem_fraction * total) - weights, free - weights) - RESERVED
    return max(1, min(args.max_batch, budget // (context * per_token)))


def run(
    label: str, classes, path: str, args: argparse.Namespace, rows: int, context: int, limit=None
) -> dict:
    engine_cls, params_cls = classes
    vocab = min(32000, json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    engine = engine_cls(path, device=args.device, seed=0, max_batch_size=rows, context_length=context,
                        mem_fraction_static=args.mem_fraction).start()  # fmt: skip
    try:
        warm = params_cls(max_new_tokens=16, temperature=1.0, ignore_eos=True)
        engine.submit([[17] * 64] * 2, warm).wait(args.timeout)  # compile, capture the first graphs
        if args.mode == "long":
            result = run_long(engine, params_cls, long_workload(args, vocab), limit or args.timeout)
        else:
            result = run_episodes(engine, params_cls, args, vocab)
        result["rows"] = rows
        log(f"  {label}: {json.dumps(result)}")
        return result
    finally:
        engine.stop()
        del engine
        free_memory(args.device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("long", "episodes"), required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-path", default=None, help="a model directory (default: a random --shape one)")
    p.add_argument("--shape", default="7b", choices=list(SHAPES))
    p.add_argument("--baseline", default=None, help="directory of a copy of the engine package")
    p.add_argument("--mem-fraction", type=float, default=0.9)
    p.add_argument("--max-batch", type=int, default=256, help="the new engine's max_running_requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument(
        "--baseline-secs",
        type=float,
        default=None,
        help="--mode long: stop the baseline after this long and report a bound on the speed-up",
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=200)
    p.add_argument("--max-prompt", type=int, default=1000)
    p.add_argument("--median", type=int, default=3000)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--tail", type=int, default=16000)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first", type=int, default=200)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--tool-tokens", type=int, default=100)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.mode == "long":
        context = args.max_prompt + args.tail
    else:
        context = args.first + args.turns * (args.turn_tokens + args.tool_tokens)
    context = -(-context // 16) * 16
    result: dict = {"mode": args.mode, "shape": args.shape, "context": context, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        path = args.model_path
        if path is None:
            path = os.path.join(tmp, "model")
            build_model(args.shape, path, args.device)
        new_cls = engine_classes(None, tmp, "engine_new")
        result["engine"] = run("engine", new_cls, path, args, args.max_batch, context)
        if args.baseline:
            base_cls = engine_classes(args.baseline, tmp, "engine_baseline")
            rows = args.max_batch if args.mode == "episodes" else baseline_rows(path, args, context)
            limit = args.baseline_secs or args.timeout
            result["baseline"] = base = run("baseline", base_cls, path, args, rows, context, limit)
            key = "tokens_per_s" if args.mode == "long" else "episodes_per_s"
            result["speedup"] = round(result["engine"][key] / base[key], 2)
            # A baseline cut off by --baseline-secs ran slower than its bound: the speed-up is at least this.
            bound = "" if base.get("done", True) else "at least "
            log(f"speed-up ({key}): {bound}{result['speedup']}x")
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
