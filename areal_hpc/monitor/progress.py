"""A progress display of a run (step, reward, ETA) from the progress file the master writes each step."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from areal_hpc.control import fsio
from areal_hpc.monitor.stats import format_secs


def write_progress(path, step: int, total: int, metric: str, value: float | None, eta_secs: float) -> None:
    """The master's side: where the run is and its headline number (`metric`: reward, or loss for SFT)."""
    progress = {"step": step, "total_steps": total, "metric": metric, "value": value, "eta_secs": eta_secs}
    fsio.write_json(path, progress)


def progress_line(p: dict) -> str:
    total = max(p["total_steps"], 1)
    done = int(24 * p["step"] / total)
    value = "   -" if p.get("value") is None else f"{p['value']:.3f}"
    return (
        f"[{'#' * done}{'.' * (24 - done)}] step {p['step']}/{p['total_steps']} "
        f"{p.get('metric', 'reward')} {value} ETA {format_secs(p['eta_secs'])}"
    )


class Progress:
    """Prints a line per finished step; on a terminal, one line rewritten in place; nothing with `out` None."""

    def __init__(self, run, out: TextIO | None = sys.stdout):
        self.path, self.out = run.progress, out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.last_step = -1

    def update(self) -> None:
        if self.out is None:
            return
        try:
            p = fsio.read_json(self.path)
        except (OSError, json.JSONDecodeError):
            return
        if not p or p["step"] == self.last_step:
            return
        self.last_step = p["step"]
        end = "\r" if self.tty else "\n"
        print(progress_line(p), end=end, file=self.out, flush=True)

    def finish(self) -> None:
        self.update()
        if self.tty and self.last_step >= 0:
            print(file=self.out)
