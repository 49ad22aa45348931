"""What the run's timeline costs (issue 46): a span recorded against the same block with recording off, in
the same run, and the cost per step at a step's event count.

    python tools/bench_timeline.py [--spans 200000] [--events-per-step 400]

An event's cost is paid by the thread that records it (a clock read, a dict, a lock) plus the flushing thread's
JSON and file append once a second; both are counted here (the run ends with the flush of the last events).
400 events a step is generous: the toy's synchronous step records about 30 (`areal-hpc trace` of a run shows
how many), a step of 512 prompts x 16 answers a generation request per group beside the controller's and the
trainers' spans.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from areal_hpc.control import timeline


def spans(n: int) -> float:
    """Seconds for `n` spans with typical arguments."""
    start = time.perf_counter()
    for i in range(n):
        with timeline.span("generate", server="gen_server3", overlap=True, step=i):
            pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spans", type=int, default=200_000)
    p.add_argument("--events-per-step", type=int, default=400)
    p.add_argument("--step-secs", type=float, default=15.0, help="a step's time, for the overhead's share")
    args = p.parse_args(argv)
    off = spans(args.spans)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trainer0.attempt0.jsonl"
        start = time.perf_counter()
        timeline.record(path)
        on = spans(args.spans)
        timeline.stop()  # the last flush: its JSON and its append count
        on_total = time.perf_counter() - start
        size = path.stat().st_size
    per_event = (on_total - off) / args.spans
    per_step = per_event * args.events_per_step
    result = {
        "spans": args.spans, "off_us": round(off / args.spans * 1e6, 3), "on_us": round(on / args.spans * 1e6, 3),
        "on_with_flush_us": round(on_total / args.spans * 1e6, 3), "cost_per_event_us": round(per_event * 1e6, 3),
        "bytes_per_event": round(size / args.spans, 1), "cost_per_step_ms": round(per_step * 1e3, 3),
        "share_of_step": per_step / args.step_secs,
    }  # fmt: skip
    print(json.dumps(result))
    print(f"a span costs {per_event * 1e6:.2f} us recorded against {off / args.spans * 1e6:.2f} us not "
          f"({on_total / off:.1f}x the empty block); {args.events_per_step} events a step: "
          f"{per_step * 1e3:.2f} ms, {100 * per_step / args.step_secs:.4f}% of a {args.step_secs:g} s step")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
