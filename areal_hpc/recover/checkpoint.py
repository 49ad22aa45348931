"""Recover checkpoints on shared storage: `RunDir.recover/step<global_step>/`, written atomically.

A checkpoint is built in a hidden temporary folder (the trainer ranks write their files into it, the
controller its state), then gets a manifest with the size and sha256 of every file (`control.manifest`, written
last) and is renamed into place: a crash at any point leaves either the whole checkpoint or none under its
final name. The newest `keep` are kept. On reading, a checkpoint whose manifest is missing or whose files do
not match it is skipped with a warning that names the bad file, and the one before it is used.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from areal_hpc.control import SnapshotError, verify_snapshot, write_manifest

logger = logging.getLogger("recover")
KIND = "recover"
_NAME = re.compile(r"^step(\d{8})$")


class Checkpoints:
    """The recover checkpoints in folder `root` (`RunDir.recover`)."""

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise ValueError(f"recover_keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step{step:08d}"

    def begin(self, step: int) -> Path:
        """A fresh, empty temporary folder to build the checkpoint of `step` in."""
        tmp = self.root / f".step{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while writing
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, known: dict[str, dict] | None = None) -> Path:
        """Seal `tmp` with its manifest (`known`: entries of files hashed as they were written), rename it into
        place, drop checkpoints beyond `keep`; its path."""
        write_manifest(tmp, {"kind": KIND, "step": step}, known)
        final = self.path(step)
        if final.exists():  # written before a restart rewound past it: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def steps(self) -> list[int]:
        """Steps of the checkpoints under their final names, oldest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _NAME.match(p.name)))

    def latest(self) -> Path | None:
        """The newest checkpoint that matches its manifest, or None; bad ones are reported and skipped."""
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                verify_snapshot(path)
                return path
            except SnapshotError as exc:
                logger.warning("recover checkpoint %s is damaged, trying the one before: %s", path, exc)
        return None

    def remove_after(self, step: int) -> None:
        """Drop checkpoints newer than `step` (a resume from an older one: they belong to a lost future)."""
        for newer in self.steps():
            if newer > step:
                shutil.rmtree(self.path(newer), ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
