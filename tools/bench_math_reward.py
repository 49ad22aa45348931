"""Agreement of the math reward with Math-Verify's own test cases.

Math-Verify's tests hold (gold, prediction, expected) triples in their ``pytest.mark.parametrize`` lists. Each
is scored as the reward scores a rollout: the prediction as the response (boxed, unless it already holds a
``\\boxed``), the gold as the reference solution (likewise), and the score is compared with ``expected``.
The test files are read, not run or imported (their triples are found with ``ast``), from a checkout of
https://github.com/huggingface/Math-Verify (nothing is downloaded here):

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    python tools/bench_math_reward.py /tmp/Math-Verify/tests [--show-disagreements]

Prints the number of triples, the agreement, and with ``--show-disagreements`` each triple scored otherwise.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

from areal_hpc.algo.math_parse import unwrapped  # noqa: E402
from areal_hpc.algo.math_verify import MathVerifier  # noqa: E402


def triples(tests: Path) -> list[tuple[str, str, bool, str]]:
    """(gold, prediction, expected, file) of every literal (str, str, number) tuple in the test files."""
    found = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Tuple) and len(node.elts) == 3:
                try:
                    gold, pred, expected = (ast.literal_eval(e) for e in node.elts)
                except ValueError:
                    continue
                if isinstance(gold, str) and isinstance(pred, str) and isinstance(expected, int | float):
                    found.append((gold, pred, bool(expected), path.name))
    return found


def boxed(text: str) -> str:
    r"""`text` as an answer in a box: ``$x$`` -> ``\boxed{x}``; left as it is when it holds a box."""
    return text if "\\boxed" in text else f"\\boxed{{{unwrapped(text.strip())}}}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tests", type=Path, help="the tests/ folder of a Math-Verify checkout")
    parser.add_argument("--show-disagreements", action="store_true")
    args = parser.parse_args()
    cases = triples(args.tests)
    with MathVerifier(n_workers=2, timeout=5.0) as verifier:
        scores = verifier.verify_batch([(boxed(pred), [boxed(gold)]) for gold, pred, _, _ in cases])
    wrong = [(case, score) for case, score in zip(cases, scores, strict=True) if (score > 0) != case[2]]
    if args.show_disagreements:
        for (gold, pred, expected, name), score in wrong:
            print(
                json.dumps({"file": name, "gold": gold, "pred": pred, "expected": expected, "score": score})
            )
    agree = len(cases) - len(wrong)
    print(f"{len(cases)} triples from {args.tests}: the reward agrees on {agree} ({agree / len(cases):.1%})")


if __name__ == "__main__":
    main()
