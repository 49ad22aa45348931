#!/usr/bin/env python3
"""A Markdown table of fault-injection results: the JSON lines that tests/test_faults.py appends to the file
named by AREAL_FAULT_REPORT, one row per line in file order.

    AREAL_FAULT_REPORT=/tmp/faults.jsonl make test-faults
    python3 tools/fault_table.py /tmp/faults.jsonl        # paste into docs/benchmarks.md

Python standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = (  # (heading, key, format of the value)
    ("fault", "fault", "{}"),
    ("survived", "survived", "{}"),
    ("samples lost", "samples_lost", "{}"),
    ("after step", "after_step", "{}"),
    ("resumed from", "resumed_from", "{}"),
    ("attempts", "attempts", "{}"),
    ("fault to next step (s)", "recovery_secs", "{:.1f}"),
    ("test (s)", "test_secs", "{:.0f}"),
    ("seed", "seed", "{}"),
)


def cell(entry: dict, key: str, fmt: str) -> str:
    value = entry.get(key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"  # a failure stands out in the pasted table
    return fmt.format(value)


def table(entries: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(e, k, f) for _, k, f in COLUMNS) + " |" for e in entries]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="the AREAL_FAULT_REPORT file")
    ns = parser.parse_args(argv)
    entries = [json.loads(line) for line in ns.report.read_text().splitlines() if line.strip()]
    if not entries:
        print(f"fault_table: {ns.report} holds no results", file=sys.stderr)
        return 1
    print(table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
