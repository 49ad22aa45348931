"""Ledger of consumed sample ids (``RunDir.ledger``), written by the controller alone.

One JSON line per step: ``{"epoch": e, "step": s, "ids": [...], "time": t}``, plus ``"dropped": true`` and
why (``"reason"``: success_rate, equal_rewards, surplus, timeout, agent_error) for prompts whose groups were
dropped (used up without training). Each line is appended with a
single write and fsync'd, so a crash can only tear the last line; readers skip a line that does not parse
(with a warning) and the writer cuts a torn tail off before its first append, so it cannot glue onto it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.control import fsio

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerRecord:
    """The ids consumed by one step."""

    epoch: int
    step: int
    ids: tuple[str, ...]
    time: float = 0.0
    dropped: bool = False
    reason: str | None = None  # why they were dropped


class Ledger:
    """Append and read the ledger file ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._repaired = False

    def record(
        self,
        epoch: int,
        step: int,
        ids: Iterable[str | int],
        dropped: bool = False,
        reason: str | None = None,
    ) -> None:
        """Append the ids that ``step`` of ``epoch`` consumed (as strings) and fsync them; ``dropped``:
        their groups were filtered out instead of trained on, for ``reason``."""
        if not self._repaired:
            self._cut_torn_tail()
            self._repaired = True
        line = {"epoch": int(epoch), "step": int(step), "ids": [str(i) for i in ids], "time": time.time()}
        if dropped:
            line["dropped"] = True
        if reason is not None:
            line["reason"] = reason
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = os.write(fd, data)  # one write: the line lands whole or, on a crash, as a torn tail
            if written != len(data):
                raise OSError(f"{self.path}: short append ({written} of {len(data)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)

    def _cut_torn_tail(self) -> None:
        try:
            with open(self.path, "rb+") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep < len(data):
                    logger.warning("%s: cutting a torn last line (%d bytes)", self.path, len(data) - keep)
                    f.truncate(keep)
                    os.fsync(f.fileno())
        except FileNotFoundError:
            pass

    def records(self) -> Iterator[LedgerRecord]:
        """Every readable record in file order; unparsable lines are skipped with a warning."""
        data = fsio.retry_estale(self._read, self.path)
        for number, raw in enumerate(data.splitlines(keepends=True), start=1):
            try:
                line = json.loads(raw)
                yield LedgerRecord(
                    int(line["epoch"]),
                    int(line["step"]),
                    tuple(line["ids"]),
                    line.get("time", 0.0),
                    bool(line.get("dropped", False)),
                    line.get("reason"),
                )
            except (ValueError, KeyError, TypeError) as exc:
                torn = "torn last line" if not raw.endswith(b"\n") else "bad line"
                logger.warning("%s: ignoring %s %d (%s): %r", self.path, torn, number, exc, raw[:80])

    def _read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def consumed(self, epoch: int) -> set[str]:
        """The ids consumed (trained on or dropped) so far in ``epoch``."""
        return {i for r in self.records() if r.epoch == epoch for i in r.ids}

    def consumed_by_epoch(self) -> dict[int, set[str]]:
        """Every epoch's consumed ids."""
        out: dict[int, set[str]] = {}
        for r in self.records():
            out.setdefault(r.epoch, set()).update(r.ids)
        return out

    def last(self) -> LedgerRecord | None:
        """The last readable record, or None for an empty ledger."""
        last = None
        for last in self.records():  # noqa: B007 - we want the final one
            pass
        return last

    def last_step(self) -> int | None:
        """The step of the last readable record, or None for an empty ledger."""
        last = self.last()
        return None if last is None else last.step
