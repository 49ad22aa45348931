"""Generate the toy arithmetic dataset used by the CPU demo and the tests.

Each line of the output JSONL files is one question in the dataset format of REFERENCE.md section 6::

    {"query_id": "toy-train-00000", "prompt": "What is 3 + 4?", "task": "math",
     "solutions": ["\\boxed{7}"], "tier": "easy"}

Questions come in three tiers so a tiny model has something to learn first:

- easy:   one operation on single digits ("What is 3 + 4?"),
- medium: one operation: sums and differences of two-digit numbers, products of a digit and a teen,
- hard:   two operations on small numbers, usual precedence ("What is 3 + 4 * 5?").

The train and test splits never share a question, and everything is a pure function of the seed.

Usage::

    python tools/make_toy_data.py --out DIR --n-train 1000 --n-test 100 --seed 1

writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path

# Share of each tier among the questions; the easy tier only holds 300 questions, so big datasets get
# relatively fewer easy ones.
TIER_WEIGHTS: dict[str, float] = {"easy": 0.5, "medium": 0.3, "hard": 0.2}
_APPLY: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_MAX_TRIES_PER_QUESTION = 50


def _easy(rng: random.Random) -> tuple[str, int]:
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
    return f"{a} {op} {b}", _APPLY[op](a, b)


def _medium(rng: random.Random) -> tuple[str, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(11, 19)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a} {op} {b}", _APPLY[op](a, b)


def _hard(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 20)
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    expression = f"{a} {op1} {b} {op2} {c}"
    if op2 == "*" and op1 != "*":  # usual precedence: the product binds first
        return expression, _APPLY[op1](a, b * c)
    return expression, _APPLY[op2](_APPLY[op1](a, b), c)


_TIERS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "easy": _easy,
    "medium": _medium,
    "hard": _hard,
}
# How many distinct questions each tier can make (the tiers never make the same expression).
_TIER_SIZES = {"easy": 10 * 10 * 3, "medium": 90 * 90 * 2 + 8 * 9, "hard": 20**3 * 3**2}


def _unique_questions(n: int, rng: random.Random) -> list[tuple[str, str, int]]:
    """Draw ``n`` distinct (tier, expression, value) triples, tiers weighted by TIER_WEIGHTS."""
    if n > sum(_TIER_SIZES.values()):
        raise ValueError(f"cannot draw {n} distinct toy questions; there are {sum(_TIER_SIZES.values())}")
    tiers, weights = list(TIER_WEIGHTS), list(TIER_WEIGHTS.values())
    seen: set[str] = set()
    out: list[tuple[str, str, int]] = []
    for _ in range(n * _MAX_TRIES_PER_QUESTION):
        if len(out) == n:
            return out
        tier = rng.choices(tiers, weights)[0]
        expression, value = _TIERS[tier](rng)
        if expression not in seen:
            seen.add(expression)
            out.append((tier, expression, value))
    if len(out) == n:
        return out
    raise ValueError(f"cannot draw {n} distinct toy questions; ask for fewer (got n={n})")


def _record(query_id: str, tier: str, expression: str, value: int) -> dict:
    return {
        "query_id": query_id,
        "prompt": f"What is {expression}?",
        "task": "math",
        "solutions": [f"\\boxed{{{value}}}"],
        "tier": tier,
    }


def make_toy_splits(n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Return (train, test) lists of dataset records; no question appears in both splits."""
    if n_train < 0 or n_test < 0:
        raise ValueError(f"split sizes must be >= 0, got n_train={n_train!r} n_test={n_test!r}")
    rng = random.Random(seed)
    questions = _unique_questions(n_train + n_test, rng)
    # Late draws hold fewer easy questions (that tier runs out first); shuffle so both splits mix tiers alike.
    rng.shuffle(questions)
    test = [_record(f"toy-test-{i:05d}", *q) for i, q in enumerate(questions[:n_test])]
    train = [_record(f"toy-train-{i:05d}", *q) for i, q in enumerate(questions[n_test:])]
    return train, test


def make_easy_splits(n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Every easy question (one operation on single digits), shuffled and split into (train, test).

    The CPU demo learns on these: a tiny model can learn them in minutes, and the held-out split shows
    whether it learned the operations rather than the answers.
    """
    questions = [(f"{a} {op} {b}", _APPLY[op](a, b)) for op in "+-*" for a in range(10) for b in range(10)]
    if not 0 <= n_test <= len(questions):
        raise ValueError(f"n_test must be in 0..{len(questions)}, got {n_test!r}")
    random.Random(seed).shuffle(questions)
    test = [_record(f"easy-test-{i:05d}", "easy", *q) for i, q in enumerate(questions[:n_test])]
    train = [_record(f"easy-train-{i:05d}", "easy", *q) for i, q in enumerate(questions[n_test:])]
    return train, test


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Write records one JSON object per line, through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def write_toy_data(out_dir: Path, n_train: int, n_test: int, seed: int) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/test.jsonl``; return their paths."""
    train, test = make_toy_splits(n_train, n_test, seed)
    train_path, test_path = Path(out_dir) / "train.jsonl", Path(out_dir) / "test.jsonl"
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    return train_path, test_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--n-train", type=int, default=1000, help="number of training questions")
    parser.add_argument("--n-test", type=int, default=100, help="number of held-out questions")
    parser.add_argument("--seed", type=int, default=1, help="random seed; same seed, same files")
    args = parser.parse_args(argv)
    for path in write_toy_data(args.out, args.n_train, args.n_test, args.seed):
        print(path)


if __name__ == "__main__":
    main()
