"""What a generation server did in each rollout of a trace (`areal-hpc trace` JSON): its prefills, its decode
stretches (rows, steps, ms a step), graph captures, full garbage collections, and when its answers went out,
in seconds from the rollout's start.

    python tools/trace_rollout.py RUN.trace.json [--server gen_server0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rollouts(trace: dict, server: str) -> list[dict]:
    """Per rollout span of the controller: its start and length, and the server's events in it."""
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("name") == "thread_name"
               and e["args"]["name"] == server}  # fmt: skip
    mine = [e for e in events if (e["pid"], e.get("tid")) in threads]
    sent = {}
    for e in mine:
        if e["name"] == "respond" and e["ph"] in "be":
            sent.setdefault(e["id"], {})[e["ph"]] = e["ts"]
    out = []
    for r in (e for e in events if e["name"] == "rollout" and names.get(e["pid"]) == "controller"):
        lo, hi = r["ts"], r["ts"] + r["dur"]
        spans = [e for e in mine if e["ph"] == "X" and lo <= e["ts"] <= hi]
        answers = sorted((s["b"] - lo) / 1e6 for s in sent.values() if "b" in s and lo <= s["b"] <= hi)
        out.append({"start": lo / 1e6, "secs": r["dur"] / 1e6, "spans": spans, "answers": answers, "lo": lo})
    return out


def describe(span: dict, lo: float) -> str:
    args = {k: v for k, v in span.get("args", {}).items() if k != "attempt"}
    line = f"  {(span['ts'] - lo) / 1e6:7.3f} s  {span['dur'] / 1e3:9.1f} ms  {span['name']:<13} {args}"
    if span["name"] == "decode" and args.get("steps"):
        line += f"  {span['dur'] / 1e3 / args['steps']:.3f} ms a step"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--server", default="gen_server0")
    args = parser.parse_args()
    for r in rollouts(json.loads(Path(args.trace).read_text()), args.server):
        print(f"rollout at {r['start']:.3f} s: {r['secs']:.3f} s")
        for span in r["spans"]:
            if span["name"] in ("prefill", "decode", "capture_graph", "gc"):
                print(describe(span, r["lo"]))
        if r["answers"]:
            print(
                f"  answers sent from {r['answers'][0]:.3f} to {r['answers'][-1]:.3f} s ({len(r['answers'])})"
            )


if __name__ == "__main__":
    main()
