"""Generate the toy code dataset: tasks asking for a function f(a, b) whose operation a word of the prompt names.

Each line of the output JSONL files is one code task in the dataset format of docs/rewards.md::

    {"query_id": "code-train-00000", "task": "code", "prompt": "Write f(a, b) that returns the sum of a and b.",
     "input_output": "{\\"inputs\\": [\\"7\\\\n3\\"], \\"outputs\\": [\\"10\\"], \\"fn_name\\": \\"f\\"}",
     "solutions": ["```\\ndef f(a, b):\\n    return a * b\\n```"], "op": "+"}

A task's operation (``op``: ``+``, ``-`` or ``*``, or those of ``ops``) is named by a word of one of a few
phrasings ("the sum of a and b", "a plus b", "adds a and b", ...). Each task has ONE function-call case: two
random digits whose sum, difference and product differ, so that a program of another operation fails it, and
scoring an answer costs one sandboxed program.

``solutions[0]`` is what a supervised warm-up learns (data/sft.py): the right program FORMAT with a RANDOM
operation of ``+ - *`` (the task's only by chance). A warm-up on it teaches how an answer looks, not which
operation is asked for, so the warmed-up model passes about one task in three and RL has the operation (one
token of the answer) left to learn. ``reference_program(op)`` is the program that passes a task's tests.

RL on the tiny model learns the operation in a few steps when the tasks share one (``--ops +``: the sampled
success goes from ~0.3 to ~0.8 in 10 GRPO steps, tests/test_code_learning.py). Telling the operations apart by
the prompt's word is learned far more slowly: even a warm-up on the RIGHT operations (32 tasks a step, lr 1e-2)
learns the format in ~50 steps but writes the asked operation in half the tasks only after ~160 steps.

The test split holds other tasks of the same prompts. Everything is a pure function of the seed.

Usage::

    python tools/make_toy_code_data.py --out DIR --n-train 256 --n-test 32 --seed 1 [--ops +]

writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `tools` namespace importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_toy_data import write_jsonl  # noqa: E402

OPS = ("+", "-", "*")
FN_NAME = "f"
# A phrasing and its word for each operation; each phrasing names all three, so that only the word tells the
# operation.
PHRASINGS: tuple[tuple[str, dict[str, str]], ...] = (
    ("Write f(a, b) that returns the {} of a and b.", {"+": "sum", "-": "difference", "*": "product"}),
    ("Write a function f(a, b) that returns a {} b.", {"+": "plus", "-": "minus", "*": "times"}),
    ("Write f(a, b) that {} a and b.", {"+": "adds", "-": "subtracts", "*": "multiplies"}),
)
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def reference_program(op: str) -> str:
    """The answer that passes the tests of a task of operation `op`: one untagged fenced block, 29 tokens of
    the tiny tokenizer (its code is 30 characters, over the verifier's 20)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return f"```\ndef {FN_NAME}(a, b):\n    return a {op} b\n```"


def _case(rng: random.Random) -> tuple[int, int]:
    """Two digits whose sum, difference and product are three different numbers."""
    while True:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if len({_APPLY[op](a, b) for op in OPS}) == len(OPS):
            return a, b


def _record(query_id: str, rng: random.Random, ops: Sequence[str]) -> dict:
    op = rng.choice(ops)
    template, words = rng.choice(PHRASINGS)
    a, b = _case(rng)
    tests = {"inputs": [f"{a}\n{b}"], "outputs": [json.dumps(_APPLY[op](a, b))], "fn_name": FN_NAME}
    return {
        "query_id": query_id,
        "task": "code",
        "prompt": template.format(words[op]),
        "input_output": json.dumps(tests),
        "solutions": [reference_program(rng.choice(OPS))],  # the format, not the task: see the docstring
        "op": op,
    }


def make_code_splits(
    n_train: int, n_test: int, seed: int, ops: Sequence[str] = OPS
) -> tuple[list[dict], list[dict]]:
    """Return (train, test) lists of code task records, each task's operation drawn from `ops`."""
    if n_train < 0 or n_test < 0:
        raise ValueError(f"split sizes must be >= 0, got n_train={n_train!r} n_test={n_test!r}")
    if not ops or not set(ops) <= set(OPS):
        raise ValueError(f"ops must be some of {OPS}, got {ops!r}")
    rng = random.Random(seed)
    train = [_record(f"code-train-{i:05d}", rng, ops) for i in range(n_train)]
    test = [_record(f"code-test-{i:05d}", rng, ops) for i in range(n_test)]
    return train, test


def write_code_data(
    out_dir: Path, n_train: int, n_test: int, seed: int, ops: Sequence[str] = OPS
) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/test.jsonl``; return their paths."""
    train, test = make_code_splits(n_train, n_test, seed, ops)
    train_path, test_path = Path(out_dir) / "train.jsonl", Path(out_dir) / "test.jsonl"
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    return train_path, test_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--n-train", type=int, default=256, help="number of training tasks")
    parser.add_argument("--n-test", type=int, default=32, help="number of held-out tasks")
    parser.add_argument("--seed", type=int, default=1, help="random seed; same seed, same files")
    parser.add_argument(
        "--ops", default="".join(OPS), help="operations the tasks ask for: '+-*' (all), '+', ..."
    )
    args = parser.parse_args(argv)
    for path in write_code_data(args.out, args.n_train, args.n_test, args.seed, tuple(args.ops)):
        print(path)


if __name__ == "__main__":
    main()
