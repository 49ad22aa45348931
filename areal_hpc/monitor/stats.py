"""Per-step statistics: a JSON line per step in stats.jsonl, and the original's step log line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class StatsLog:
    """Appends `{"step": g, "time": t, name: value, ...}` lines; one writer (the master). `followers`
    (TensorBoard, W&B: monitor.writers) get each row after it is on disk."""

    def __init__(self, path: Path, followers: list | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.followers = followers or []

    def write(self, step: int, stats: dict[str, float]) -> None:
        line = json.dumps({"step": step, "time": time.time(), **stats}, sort_keys=False)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        for follower in self.followers:
            follower.write(step, stats)

    def close(self) -> None:
        for follower in self.followers:
            follower.close()
        self.followers = []


def read_stats(path: Path) -> list[dict]:
    """Every complete line of a stats file (a torn last line is skipped)."""
    out = []
    if not Path(path).is_file():
        return out
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def format_secs(secs: float) -> str:
    secs = int(secs)
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def step_line(counter, secs: float) -> str:
    """The original's line: `Epoch e/E step s/S (global step g) finishes. #End to end# execution time ...`."""
    c = counter
    epoch = (c.global_step - 1) // c.steps_per_epoch + 1
    epoch_step = (c.global_step - 1) % c.steps_per_epoch + 1
    return (
        f"Epoch {epoch}/{c.total_epochs} step {epoch_step}/{c.steps_per_epoch} "
        f"(global step {c.global_step}) finishes. #End to end# execution time: {secs:.2f}s. "
        f"Estimated remaining time: {format_secs(c.eta_secs())}."
    )
