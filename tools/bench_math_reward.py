"""Agreement of the math reward with Math-Verify's own test cases, and its verdicts on the evaluation sets.

Math-Verify's tests hold (gold, prediction, expected) triples in their ``pytest.mark.parametrize`` lists. Each
is scored as the reward scores a rollout: the prediction as the response (boxed, unless it already holds a
``\\boxed``), the gold as the reference solution (likewise), and the score is compared with ``expected``.
The test files are read, not run or imported (their triples are found with ``ast``), from a checkout of
https://github.com/huggingface/Math-Verify (nothing is downloaded here):

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    python tools/bench_math_reward.py /tmp/Math-Verify/tests [--show-disagreements]

Prints the number of triples, the agreement, and with ``--show-disagreements`` each triple scored otherwise.

With ``--eval-sets DIR`` (the folder of aime24.jsonl, ...), each ``answer`` of the evaluation sets is the
reference of a few responses: itself, its neighbour's answer, and for a number its variants: rounded to 4
and to 2 decimals, as a percentage with and without its sign (where that is exact to 4 decimals), plus one
and x100 for an integer. Prints, for each kind of variant, how many the reward accepts and how many the rule
of docs/rewards.md should: a decimal within a relative 1e-4, a percentage with its sign, and one without it
where the reference is a plain decimal (1.25, not \\frac{5}{4}), as the original; never an integer x100
(the original takes 100 for 1) nor plus one. With ``--show-disagreements``, each response scored otherwise.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `areal_hpc` importable

from math_verify import LatexExtractionConfig, parse  # noqa: E402

from areal_hpc.algo.math_numbers import first_sympy, number_value, plain_number  # noqa: E402
from areal_hpc.algo.math_parse import as_text, unwrapped  # noqa: E402
from areal_hpc.algo.math_verify import MathVerifier  # noqa: E402

EVAL_SETS = ("aime24", "aime25", "amc23", "math_500")


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


def bench_tests(verifier: MathVerifier, tests: Path, show: bool) -> None:
    cases = triples(tests)
    scores = verifier.verify_batch([(boxed(pred), [boxed(gold)]) for gold, pred, _, _ in cases])
    wrong = [(case, score) for case, score in zip(cases, scores, strict=True) if (score > 0) != case[2]]
    if show:
        for (gold, pred, expected, name), score in wrong:
            print(
                json.dumps({"file": name, "gold": gold, "pred": pred, "expected": expected, "score": score})
            )
    agree = len(cases) - len(wrong)
    print(f"{len(cases)} triples from {tests}: the reward agrees on {agree} ({agree / len(cases):.1%})")


def decimal(value: float, places: int) -> str:
    """`value` to `places` decimals, without trailing zeros (a percentage is written as people write it)."""
    text = f"{value:.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def variants(answer: str, neighbour: str) -> list[tuple[str, str, bool]]:
    """(kind, response answer, whether the rule should accept it) for one reference answer."""
    found = [("itself", answer, True)]
    if answer.replace(" ", "") != neighbour.replace(" ", ""):
        found.append(("neighbour's answer", neighbour, False))
    value = number_value(
        first_sympy(parse(f"\\boxed{{{answer}}}", [LatexExtractionConfig()], parsing_timeout=None))
    )
    if value is None:
        return found
    if value.denominator == 1:
        found.append(("integer + 1", str(value + 1), False))
        return found + ([("integer x100", str(100 * value), False)] if value else [])
    for places in (4, 2):
        text = decimal(float(value), places)
        found.append((f"{places} decimals", text, math.isclose(float(value), float(text), rel_tol=1e-4)))
    percent = 100 * value
    if (percent * 10_000).denominator == 1:  # exact to 4 decimals
        text = decimal(float(percent), 4)
        plain = plain_number(answer) is not None  # the original scales only a plain decimal, as here
        found += [("percentage", text + "\\%", True), ("percentage, no sign", text, plain)]
    return found


def bench_eval_sets(verifier: MathVerifier, folder: Path, show: bool) -> None:
    cases = []
    for name in EVAL_SETS:
        with (folder / f"{name}.jsonl").open() as lines:
            answers = [as_text(json.loads(line)["answer"], "answer") for line in lines]
        for answer, neighbour in zip(answers, answers[1:] + answers[:1], strict=True):
            cases += [
                (kind, response, answer, expected) for kind, response, expected in variants(answer, neighbour)
            ]
    scores = verifier.verify_batch([(f"\\boxed{{{response}}}", [answer]) for _, response, answer, _ in cases])
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # cases, accepted, expected, agreeing
    for (kind, response, answer, expected), score in zip(cases, scores, strict=True):
        accepted = score > 0
        if show and accepted != expected:
            print(json.dumps({"variant": kind, "answer": answer, "response": response, "score": score}))
        counts = (1, accepted, expected, accepted == expected)
        table[kind] = [total + int(count) for total, count in zip(table[kind], counts, strict=True)]
    print(f"{len(cases)} responses to the answers of {', '.join(EVAL_SETS)} in {folder}:")
    print(f"{'variant':<22}{'cases':>7}{'accepted':>10}{'expected':>10}{'agree':>7}")
    for kind, (n, accepted, expected, agree) in table.items():
        print(f"{kind:<22}{n:>7}{accepted:>10}{expected:>10}{agree:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tests", type=Path, nargs="?", help="the tests/ folder of a Math-Verify checkout")
    parser.add_argument("--show-disagreements", action="store_true")
    parser.add_argument(
        "--eval-sets", type=Path, help="the folder of the evaluation sets (aime24.jsonl, ...)"
    )
    args = parser.parse_args()
    if args.tests is None and args.eval_sets is None:
        parser.error("give the tests/ folder of a Math-Verify checkout, --eval-sets DIR, or both")
    with MathVerifier(n_workers=2, timeout=5.0) as verifier:
        if args.tests is not None:
            bench_tests(verifier, args.tests, args.show_disagreements)
        if args.eval_sets is not None:
            bench_eval_sets(verifier, args.eval_sets, args.show_disagreements)


if __name__ == "__main__":
    main()
