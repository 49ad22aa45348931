"""Generate the toy tool-use dataset: products the tiny model can only get right by calling a calculator.

Each line of the output JSONL files is one question in the dataset format of REFERENCE.md section 6, plus the
transcript a supervised warm-up learns::

    {"query_id": "tool-train-00000", "prompt": "What is 47 * 38? Use the calculator.", "task": "math",
     "solutions": ["\\boxed{1786}"], "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": "47 * 38"}}}]},
        {"role": "tool", "name": "calculator", "content": "1786"},
        {"role": "assistant", "content": "\\boxed{1786}"}]}

``messages`` is what follows the user turn (the prompt): one calculator call, the tool's result, and the boxed
answer copied from it. The call's operation is drawn at random (+, - or *, as the code toy's warm-up programs
are): a warm-up on these conversations learns to call the tool and copy its answer, and answers right about
one time in three, which leaves GRPO a choice to learn (write the question's * in the call). The products are of two 2-digit numbers (four in five)
or of a 3-digit number and a digit from 2 to 9: a 2-layer model of width 64 cannot multiply them, but it can
learn to copy the expression into a call and the result into the box.

The train and test splits never share a pair of factors, in either order (47 * 38 and 38 * 47 are one
question), and everything is a pure function of the seed. The tokenizer never sees these questions.

Usage::

    python tools/make_toy_tool_data.py --out DIR --n-train 1000 --n-test 64 --seed 1

writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `tools` namespace importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_toy_data import write_jsonl  # noqa: E402

CALCULATOR = "calculator"
# The schema to pass as ``tools=[...]`` to apply_chat_template; the tiny template prints only its name.
CALCULATOR_TOOL: dict = {
    "type": "function",
    "function": {
        "name": CALCULATOR,
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 47 * 38"}},
            "required": ["expression"],
        },
    },
}
SHARE_THREE_BY_ONE = 0.2  # of the questions: 3-digit times 1-digit; the rest are 2-digit times 2-digit
# Distinct unordered factor pairs: 2-digit x 2-digit (90 * 91 / 2), 3-digit x digit 2..9 (900 * 8).
_N_PAIRS = 90 * 91 // 2 + 900 * 8
_MAX_TRIES_PER_QUESTION = 50


def _factors(rng: random.Random) -> tuple[int, int]:
    """Two factors, in the order the question shows them."""
    if rng.random() < SHARE_THREE_BY_ONE:
        return rng.randint(100, 999), rng.randint(2, 9)
    return rng.randint(10, 99), rng.randint(10, 99)


def _unique_factor_pairs(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """Draw ``n`` factor pairs, no two of the same factors in either order (so no answer is shared)."""
    if n > _N_PAIRS:
        raise ValueError(f"cannot draw {n} distinct tool questions; there are {_N_PAIRS}")
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    for _ in range(n * _MAX_TRIES_PER_QUESTION):
        if len(out) == n:
            break
        a, b = _factors(rng)
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            out.append((a, b))
    if len(out) < n:
        raise ValueError(f"cannot draw {n} distinct tool questions; ask for fewer")
    return out


def tool_transcript(expression: str, value: int) -> list[dict]:
    """The turns after the user's: call the calculator, read its result, box it (OpenAI message shapes)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": CALCULATOR, "arguments": {"expression": expression}},
    }
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": CALCULATOR, "content": str(value)},
        {"role": "assistant", "content": f"\\boxed{{{value}}}"},
    ]


OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _record(query_id: str, a: int, b: int, op: str) -> dict:
    """The question of a * b, its answer, and a worked conversation that calls the calculator with ``op``."""
    return {
        "query_id": query_id,
        "prompt": f"What is {a} * {b}? Use the calculator.",
        "task": "math",
        "solutions": [f"\\boxed{{{a * b}}}"],
        "messages": tool_transcript(f"{a} {op} {b}", OPS[op](a, b)),
    }


def make_tool_splits(n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Return (train, test) lists of tool-use records; no pair of factors appears in both splits."""
    if n_train < 0 or n_test < 0:
        raise ValueError(f"split sizes must be >= 0, got n_train={n_train!r} n_test={n_test!r}")
    pairs = _unique_factor_pairs(n_train + n_test, random.Random(seed))
    ops = random.Random(seed + 1).choices(list(OPS), k=len(pairs))
    records = [(pair, op) for pair, op in zip(pairs, ops, strict=True)]
    test = [_record(f"tool-test-{i:05d}", *pair, op) for i, (pair, op) in enumerate(records[:n_test])]
    train = [_record(f"tool-train-{i:05d}", *pair, op) for i, (pair, op) in enumerate(records[n_test:])]
    return train, test


def write_tool_data(out_dir: Path, n_train: int, n_test: int, seed: int) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/test.jsonl``; return their paths."""
    train, test = make_tool_splits(n_train, n_test, seed)
    train_path, test_path = Path(out_dir) / "train.jsonl", Path(out_dir) / "test.jsonl"
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    return train_path, test_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--n-train", type=int, default=1000, help="number of training questions")
    parser.add_argument("--n-test", type=int, default=64, help="number of held-out questions")
    parser.add_argument("--seed", type=int, default=1, help="random seed; same seed, same files")
    args = parser.parse_args(argv)
    for path in write_tool_data(args.out, args.n_train, args.n_test, args.seed):
        print(path)


if __name__ == "__main__":
    main()
