"""`areal-hpc trace`: the run's timeline (control/timeline.py) as a Chrome/Perfetto trace and a per-step table.

In the trace a process per role (controller, rollout, trainer, gen_server) holds a thread per task; spans that
ran beside others (`overlap`: generation requests in flight) are async slices. A span that names a server
(`server=gen_server0`: a request to it) is drawn on that server's track as well, so that a server's track
shows what it was asked to do, whatever its backend. Steps are the controller's `step` spans: the table gives
each step's wall time, the controller's parts of it (what is left over is `other`), and each role's idle
share: the part of the step its tasks spent in no span, averaged over the role's tasks.

The files come from shared storage and every process of the run: a line that is no event (a torn last line
of a process that died) is skipped and counted, never fatal.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = re.compile(r"^(?P<task>[a-z_]+\d*)\.attempt(?P<attempt>\d+)\.jsonl$")
PROFILE = "profile.*.json"  # the trainers' torch.profiler traces (train/worker.py)
ROLES = ("controller", "rollout", "trainer", "gen_server")  # the trace's process order


@dataclass(frozen=True)
class Event:
    task: str
    attempt: int
    name: str
    ts: float  # Unix seconds
    dur: float | None  # seconds; None: an instant
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + (self.dur or 0.0)

    @property
    def overlap(self) -> bool:
        return bool(self.args.get("overlap"))


def role_of(task: str) -> str:
    return task.rstrip("0123456789")


def parse_event(line: str, task: str, attempt: int) -> Event | None:
    """The event of one line, or None if it is none (torn, or not what a recorder writes)."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    name, ts, dur = raw.pop("name", None), raw.pop("ts", None), raw.pop("dur", None)
    if not isinstance(name, str) or not _finite(ts) or not (dur is None or _finite(dur) and dur >= 0):
        return None
    return Event(task, attempt, name, float(ts), None if dur is None else float(dur), raw)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def read_timeline(folder: Path) -> tuple[list[Event], int]:
    """Every event of the run's timeline folder, in time order, and how many lines were skipped."""
    events, skipped = [], 0
    for path in sorted(folder.glob("*.jsonl")):
        m = FILE.match(path.name)
        if m is None:
            continue
        task, attempt = m["task"], int(m["attempt"])
        for line in path.read_text(errors="replace").splitlines():
            event = parse_event(line, task, attempt) if line.strip() else None
            skipped += event is None and bool(line.strip())
            if event is not None:
                events.append(event)
    events += [_on_server(e) for e in events if isinstance(e.args.get("server"), str) and e.dur is not None]
    return sorted(events, key=lambda e: e.ts), skipped


def _on_server(event: Event) -> Event:
    """A request to a server as that server's span (its track, its role's idle time)."""
    args = {k: v for k, v in event.args.items() if k != "server"} | {"from": event.task}
    return Event(event.args["server"], event.attempt, event.name, event.ts, event.dur, args)


# --- steps ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    step: int
    attempt: int
    start: float
    end: float
    parts: dict[str, float]  # the controller's spans directly inside the step: name -> seconds

    @property
    def wall(self) -> float:
        return self.end - self.start


def steps_of(events: list[Event]) -> list[Step]:
    """The controller's steps, each with the seconds of its parts."""
    mine = Spans([e for e in events if e.task == "controller" and e.dur is not None and not e.overlap])
    steps = []
    for s in (e for e in mine.spans if e.name == "step" and isinstance(e.args.get("step"), int)):
        inside = [e for e in mine.within(s.ts, s.end) if e is not s and s.ts <= e.ts and e.end <= s.end]
        parts: dict[str, float] = defaultdict(float)
        for e in inside:  # a direct part: inside no other span of the step
            if not any(o is not e and o.ts <= e.ts and e.end <= o.end and o.dur > e.dur for o in inside):
                parts[e.name] += e.dur
        steps.append(Step(s.args["step"], s.attempt, s.ts, s.end, dict(parts)))
    return steps


class Spans:
    """Spans in time order, for the ones that meet an interval (runs of days hold millions)."""

    def __init__(self, spans: list[Event]):
        self.spans = sorted(spans, key=lambda e: e.ts)
        self.starts = [e.ts for e in self.spans]
        self.longest = max((e.dur for e in self.spans), default=0.0)

    def within(self, lo: float, hi: float) -> list[Event]:
        first = bisect.bisect_left(self.starts, lo - self.longest)
        return [e for e in self.spans[first : bisect.bisect_right(self.starts, hi)] if e.end >= lo]


def select_steps(steps: list[Step], spec: str | None) -> list[Step]:
    """The steps of `--steps A:B` (both ends included; either may be left out) or `--steps N`."""
    if not spec:
        return steps
    lo, sep, hi = spec.partition(":")
    try:
        first = int(lo) if lo else 0
        last = int(hi) if hi else (math.inf if sep else first)
    except ValueError as exc:
        raise ValueError(f"--steps {spec!r}: expected A:B, A:, :B or N (global steps, 1-based)") from exc
    return [s for s in steps if first <= s.step <= last]


def busy_secs(spans: Spans, lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one of `spans`."""
    pieces = sorted((max(e.ts, lo), min(e.end, hi)) for e in spans.within(lo, hi))
    busy, reach = 0.0, lo
    for a, b in pieces:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy


def step_rows(events: list[Event], steps: list[Step]) -> list[dict[str, Any]]:
    """A row per step: step, attempt, wall, the controller's parts, `other`, and `idle <role>` (a fraction)."""
    by_task: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for e in events:
        by_task[e.task, e.attempt] += [e] if e.dur is not None else []
    spans = {task: Spans(found) for task, found in by_task.items()}
    rows = []
    for s in steps:
        row: dict[str, Any] = {"step": s.step, "attempt": s.attempt, "wall": s.wall, **s.parts}
        row["other"] = s.wall - sum(s.parts.values())
        idle: dict[str, list[float]] = defaultdict(list)
        for task, attempt in sorted(spans):
            if attempt == s.attempt and task != "controller":
                busy = busy_secs(spans[task, attempt], s.start, s.end)
                idle[role_of(task)].append(1.0 - busy / s.wall if s.wall > 0 else 0.0)
        row |= {f"idle {role}": sum(v) / len(v) for role, v in sorted(idle.items())}
        rows.append(row)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The per-step table: seconds, and idle shares in percent."""
    if not rows:
        return "no finished step on the timeline yet"
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    idle = [c for c in columns if c.startswith("idle ")]
    columns = [c for c in columns if c not in idle and c != "other"] + ["other"] + idle

    def cell(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key in ("step", "attempt"):
            return str(value)
        return f"{100 * value:.0f}%" if key.startswith("idle ") else f"{value:.2f}"

    table = [columns] + [[cell(c, row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in table)


# --- the Chrome trace -----------------------------------------------------------------------------------------


def chrome_trace(events: list[Event], window: tuple[float, float] | None = None, profiles=()) -> dict:
    """The Chrome trace-event JSON of `events` (those that meet `window`, in Unix seconds) and of the
    torch.profiler traces `profiles` ((label, its JSON) each). Times in microseconds from the first event."""
    tasks = sorted({e.task for e in events}, key=_task_order)  # a track each, busy in the window or not
    if window is not None:
        lo, hi = window
        events = [e for e in events if (lo <= e.ts <= hi if e.dur is None else e.end > lo and e.ts < hi)]
    t0 = min((e.ts for e in events), default=0.0)
    pids = {role: i + 1 for i, role in enumerate(ROLES)}
    out: list[dict] = []
    threads: dict[str, tuple[int, int]] = {}
    for task in tasks:
        role = role_of(task)
        pid = pids.setdefault(role, len(pids) + 1)
        threads[task] = pid, int(task[len(role) :] or 0)
    for role, pid in pids.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}})
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for task, (pid, tid) in threads.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": task}})
    for n, e in enumerate(events):
        pid, tid = threads[e.task]
        base = {"name": e.name, "pid": pid, "tid": tid, "ts": round((e.ts - t0) * 1e6, 3)}
        args = {"attempt": e.attempt, **{k: v for k, v in e.args.items() if k != "overlap"}}
        if e.dur is None:
            out.append(base | {"ph": "i", "s": "t", "args": args})
        elif e.overlap:  # an async slice: Perfetto gives overlapping requests tracks of their own
            out.append(base | {"ph": "b", "cat": e.name, "id": n, "args": args})
            out.append(base | {"ph": "e", "cat": e.name, "id": n, "ts": round((e.end - t0) * 1e6, 3)})
        else:
            out.append(base | {"ph": "X", "dur": round(e.dur * 1e6, 3), "args": args})
    for i, (label, trace) in enumerate(profiles):
        out += profile_events(trace, label, 100 + i, t0)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _task_order(task: str) -> tuple[int, int]:
    role = role_of(task)
    return (ROLES.index(role) if role in ROLES else len(ROLES), int(task[len(role) :] or 0))


def profile_events(trace: dict, label: str, pid: int, t0: float) -> list[dict]:
    """A torch.profiler trace's events as process `pid` named `label`, on the timeline's clock (the trace's
    times are microseconds after its `baseTimeNanoseconds`)."""
    shift = trace.get("baseTimeNanoseconds", 0) / 1e3 - t0 * 1e6
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}}]
    for e in trace.get("traceEvents", []):
        if not isinstance(e, dict) or e.get("ph") == "M" and e.get("name") == "process_name":
            continue
        e = dict(e, pid=pid)
        if _finite(e.get("ts")):
            e["ts"] = round(e["ts"] + shift, 3)
        out.append(e)
    return out


def read_profiles(folder: Path) -> list[tuple[str, dict]]:
    """(label, trace) of the trainers' profiles in `folder` (`logging.profile_step`)."""
    found = []
    for path in sorted(folder.glob(PROFILE)):
        try:
            trace = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents", []), list):
            continue  # not a torch.profiler trace
        if not _finite(trace.get("baseTimeNanoseconds", 0)):
            continue
        found.append((path.stem.removeprefix("profile."), trace))
    return found


def write_trace(run, out: Path | None, steps_spec: str | None = None, cuda: bool = False) -> tuple[Path, str]:
    """`areal-hpc trace`: the trace file of `run` (a RunDir) and the per-step table, as printed."""
    folder = run.timeline
    events, skipped = read_timeline(folder)
    if not events:
        raise FileNotFoundError(
            f"no timeline in {folder} (logging.timeline: false, or the run has not started)"
        )
    steps = select_steps(steps_of(events), steps_spec)
    window = None
    if steps_spec:
        if not steps:
            raise ValueError(f"--steps {steps_spec}: no such finished step on the timeline of {run.root}")
        window = (min(s.start for s in steps), max(s.end for s in steps))
    profiles = read_profiles(folder) if cuda else []
    if cuda and not profiles:
        raise FileNotFoundError(f"no trainer profile in {folder}: run with logging.profile_step=N first")
    trace = chrome_trace(events, window, profiles)
    out = out or folder.parent / "trace.json"
    out.write_text(json.dumps(trace))
    table = format_rows(step_rows(events, steps))
    if skipped:
        table += f"\n({skipped} line(s) of the timeline were no events and were skipped)"
    return out, table
