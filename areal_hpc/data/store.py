"""The rollout store: finished groups from the rollout side, waiting to be trained on, as HDF5 files.

One file per group in the store's folder (``RunDir.rollouts``), written tmp + rename by `data.batch.write_batch`, named
``<birth time in ms>-w<worker>-<sequence>.h5`` (birth: when the rollout started) so that name order is age
order: the trainer side takes the oldest finished groups first. A file is removed only after the step that
trained on it ended, so nothing is lost in a crash. A group that was dropped (its answers' rewards all equal
under dynamic sampling, its success rate filtered out, its episodes past their time) leaves a small marker in
``dropped/`` instead, so that the controller records its prompt as used (exactly-once accounting).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_hpc.control import fsio
from areal_hpc.data.batch import write_batch


class RolloutStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def put(
        self, worker: int, sequence: int, birth: float, arrays: Mapping[str, Any], attrs: Mapping[str, Any]
    ) -> Path:
        """Store one finished group born (its rollout started) at unix time `birth`; returns the file."""
        self.root.mkdir(parents=True, exist_ok=True)
        return write_batch(self.root / f"{_name(worker, sequence, birth)}.h5", arrays, attrs)

    def put_dropped(
        self,
        worker: int,
        sequence: int,
        birth: float,
        query_id: str,
        epoch: int,
        reason: str = "success_rate",
    ) -> Path:
        """Mark the group of `query_id` (of prompt epoch `epoch`) as dropped, saying why: the success-rate
        filter, dynamic sampling ("equal_rewards"), episodes past their time ("timeout"), an agent's error."""
        path = self.root / "dropped" / f"{_name(worker, sequence, birth)}.json"
        fsio.write_json(path, {"query_id": query_id, "epoch": epoch, "reason": reason})
        return path

    def dropped(self) -> list[tuple[Path, dict]]:
        """Drop markers not yet recorded, oldest first: (file, {"query_id", "epoch", "reason"})."""
        folder = self.root / "dropped"
        found = [(folder / n, fsio.read_json(folder / n)) for n in self._dropped_names()]
        return [(path, info) for path, info in found if info is not None]

    def n_dropped(self) -> int:
        """How many drop markers are not yet recorded (without reading them)."""
        return len(self._dropped_names())

    def _dropped_names(self) -> list[str]:
        return [n for n in fsio.list_names(self.root / "dropped") if n.endswith(".json")]

    def ready(self) -> list[Path]:
        """Every stored group, oldest first (temporary files of writes in progress are not listed)."""
        return [self.root / n for n in fsio.list_names(self.root) if n.endswith(".h5")]

    def remove(self, paths: list[Path]) -> None:
        """Drop groups that were trained on (or drop markers that were recorded)."""
        for path in paths:
            fsio.remove(path)


def _name(worker: int, sequence: int, birth: float) -> str:
    return f"{int(birth * 1000):013d}-w{worker:03d}-{sequence:08d}"
