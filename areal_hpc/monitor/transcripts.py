"""Transcripts of episodes: a JSON line per episode (gen.transcript renders it), one file per step in the run's
logs/episodes/, of the first rollout.transcript_groups groups of each step to finish.

A group's step is 1 + the weight version its first sampled token came from: in a synchronous run the step that
trains it, in an asynchronous run the first step that can (one up to max_head_offpolicyness later does). A
group's lines are appended in one write, so a crash leaves at most a torn last line, which readers skip.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from areal_hpc.control import RunDir

logger = logging.getLogger(__name__)


class TranscriptLog:
    """Where a rollout process writes the transcripts of the first ``groups`` groups of each step."""

    def __init__(self, run: RunDir, groups: int):
        self.run, self.groups = run, groups
        self._kept: dict[int, int] = {}  # step -> groups written
        self._newest = 0  # the newest weight version a group came from
        self._lock = threading.Lock()

    def admit(self, version: int | None) -> int | None:
        """The step of a finished group whose first token came from weight ``version`` (None: it sampled none;
        it goes with the newest), when it is one of the step's first ``groups``; else None."""
        with self._lock:
            self._newest = max(self._newest, version or 0)
            step = (self._newest if version is None else version) + 1
            if step not in self._kept:  # a restarted process goes on counting where the last one stopped
                self._kept[step] = len({(e.get("query_id"), e.get("epoch")) for e in self.read(step)})
            if self._kept[step] >= self.groups:
                return None
            self._kept[step] += 1
            return step

    def read(self, step: int) -> list[dict]:
        return read_transcripts(self.run, step)

    def write(self, step: int, episodes: list[dict]) -> None:
        """Append a group's episodes, a line each, in one write; a failure is logged (the run goes on)."""
        data = "".join(json.dumps(e) + "\n" for e in episodes).encode()  # ASCII: a lone surrogate too
        path = self.run.transcript(step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # after a torn line: on a line of their own
                    data = b"\n" + data
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("transcripts of step %d not written to %s: %s", step, path, exc)


def read_transcripts(run: RunDir, step: int) -> list[dict]:
    """The episodes of step ``step`` (none when it has no file); torn or foreign lines are skipped."""
    try:
        lines = run.transcript(step).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            episode = json.loads(line)
        except ValueError:
            continue
        if isinstance(episode, dict):
            out.append(episode)
    return out


def transcript_steps(run: RunDir) -> list[int]:
    """The steps that have transcripts, in order."""
    found = []
    for path in run.transcripts.glob("*.jsonl") if run.transcripts.is_dir() else ():
        digits = "".join(c for c in path.stem if c.isdigit())
        if digits and run.transcript(int(digits)) == path:  # the file name RunDir gives that step
            found.append(int(digits))
    return sorted(found)
