"""Cut a run directory back to the step a resume starts from, so that nothing of a lost future survives.

After a crash at step k > S, resuming from the checkpoint of step S leaves traces of steps S+1..k: ledger
records and statistics (the data would count as used twice), persistent and recover checkpoints, weight
snapshots and step data. `rewind` removes them, and puts back the ledger and the rollout store as the
checkpoint saved them (asynchronous RL: groups finished after the checkpoint are generated again). Rewinding
to step 0 is a fresh start in a used directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from areal_hpc.control import RunDir, fsio
from areal_hpc.recover.checkpoint import Checkpoints

_VERSION = re.compile(r"^v(\d+)$")


def rewind(run: RunDir, step: int, version: int, saved: Path | None = None) -> None:
    """Make `run` look as it did right after global step `step` (weight `version`); `saved`: the recover
    checkpoint holding the ledger and rollout store of that moment (None: a fresh start, both empty)."""
    # A recover checkpoint holds copies of the ledger and the store under their names in the run directory.
    ledger, store = run.ledger, run.rollouts
    if saved is not None and (saved / ledger.name).is_file():  # whole or not at all: the ledger is the truth
        fsio.write_bytes(ledger, (saved / ledger.name).read_bytes(), fsync=True)
    else:
        _keep_lines(ledger, lambda rec: rec["step"] <= step)
    _keep_lines(run.stats, lambda row: row["step"] <= step)
    shutil.rmtree(run.data, ignore_errors=True)
    for role in run.checkpoints.glob("*"):
        for saved_at, ckpt in run.saved_checkpoints(role.name).items():
            if saved_at > step:
                shutil.rmtree(ckpt)
    for snapshot in run.weights.glob("v*"):
        if (m := _VERSION.match(snapshot.name)) and int(m.group(1)) > version:
            shutil.rmtree(snapshot)
    for adapter in run.weights.glob("adapter-v*"):  # a LoRA run's: the resume publishes its version anew
        shutil.rmtree(adapter)
    Checkpoints(run.recover).remove_after(step)
    shutil.rmtree(store, ignore_errors=True)
    if saved is not None and (saved / store.name).is_dir():
        _link_tree(saved / store.name, store)
    if run.published_version.exists() or version:
        fsio.write_json(run.published_version, {"version": version}, fsync=True)


def _keep_lines(path: Path, keep) -> None:
    """Rewrite a JSON-lines file with the lines `keep` accepts (unreadable ones go), atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if keep(json.loads(line)):
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    fsio.write_bytes(path, "".join(kept).encode(), fsync=True)


def save_into(run: RunDir, ckpt: Path) -> None:
    """The ledger and the rollout store, as they are now, into the recover checkpoint being built at `ckpt`.

    The store's files are hard links (a copy where links are not allowed): cheap, and the store may remove
    its own names later without touching the checkpoint's."""
    if run.ledger.is_file():
        shutil.copyfile(run.ledger, ckpt / run.ledger.name)
    if run.rollouts.is_dir():
        _link_tree(run.rollouts, ckpt / run.rollouts.name)


def _link_tree(src: Path, dst: Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file() and not path.name.startswith("."):  # hidden: a write in progress
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
