"""Submitted runs as a user sees them: find, list, stop, logs (`areal-hpc list|stop|logs`; status: run_status)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from areal_hpc.config import ExperimentConfig, load_config
from areal_hpc.control import RunDir, fsio, user_root
from areal_hpc.launch import slurm

DEFAULT_FILEROOT = ExperimentConfig().cluster.fileroot


class RunNotFound(LookupError):
    pass


def is_config(args: list[str]) -> bool:
    """Whether verb arguments are config files and overrides (else a run)."""
    return any(a.endswith((".yaml", ".yml")) or "=" in a for a in args)


def select_runs(args: list[str], fileroot: str | None = None) -> list[RunDir]:
    """The runs that a verb's arguments name, oldest first:
    - a run directory, or `experiment/trial` under the fileroot: that run;
    - config files and overrides: the runs of their experiment under their cluster.fileroot (the run of
      their trial_name, if set);
    - nothing: every run under the fileroot.
    `fileroot`, when given, wins over the config's; the default is cluster.fileroot's."""
    if args and not is_config(args):
        if len(args) > 1:
            raise RunNotFound(f"give one run, not {len(args)}: {' '.join(args)}")
        return [find_run(args[0], fileroot or DEFAULT_FILEROOT)]
    if not args:
        return list_runs(fileroot or DEFAULT_FILEROOT)
    cfg = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
    runs = [
        r for r in list_runs(fileroot or cfg.cluster.fileroot) if r.root.parent.name == cfg.experiment_name
    ]
    return [r for r in runs if cfg.trial_name in (None, r.root.name)]


def find_run(name: str, fileroot: str = DEFAULT_FILEROOT) -> RunDir:
    """A run directory given as a path, or as `experiment/trial` under `<fileroot>/<user>`."""
    for candidate in (RunDir(Path(name)), RunDir(user_root(fileroot) / name)):
        if candidate.config.is_file():
            return RunDir(candidate.root.resolve())
    raise RunNotFound(f"no run {name!r}: give its directory, or experiment/trial under {fileroot}/<user>")


def list_runs(fileroot: str = DEFAULT_FILEROOT) -> list[RunDir]:
    """Every run under `<fileroot>/<user>`, oldest first."""
    runs = [RunDir(p) for p in user_root(fileroot).glob("*/*")]
    return sorted((r for r in runs if r.config.is_file()), key=lambda r: r.config.stat().st_mtime)


def recorded_jobs(run: RunDir) -> list[dict]:
    """Every Slurm job recorded for the run, oldest submission first ([] for a local run)."""
    record = fsio.read_json(run.jobs)
    return record["jobs"] if record else []


def slurm_jobs(run: RunDir) -> list[dict]:
    """The Slurm jobs of the run's newest submission (`submit --recover` adds one); [] for a local run."""
    jobs = recorded_jobs(run)
    newest = max((j.get("submission", 0) for j in jobs), default=0)
    return [j for j in jobs if j.get("submission", 0) == newest]


def job_ids(run: RunDir) -> list[str]:
    return [j["job_id"] for j in slurm_jobs(run)]


def stop(run: RunDir, timeout: float = 60.0) -> dict[str, str]:
    """scancel every job of the run; returns the final state of each component once all have ended."""
    ids = job_ids(run)
    if not ids:
        raise RunNotFound(f"{run.root} has no Slurm jobs (a local run stops with Ctrl-C)")
    slurm.cancel(ids)
    return slurm.wait_final(ids, timeout)


def log_files(run: RunDir, role: str | None = None) -> list[Path]:
    """Role logs of the latest attempt (all roles, or those named `role`, e.g. `trainer` or `trainer1`)."""
    attempts = sorted(run.logs.glob("attempt*"), key=lambda p: int(p.name.removeprefix("attempt") or 0))
    files = sorted(attempts[-1].glob("*.log")) if attempts else []
    return [f for f in files if role is None or f.stem == role or f.stem.rstrip("0123456789") == role]


def follow(
    find: Callable[[], list[Path]], out: TextIO, done: Callable[[], bool], interval: float = 0.5
) -> None:
    """Print what is appended to the files `find()` returns until `done()` (like `tail -f` on several files)."""
    offsets: dict[Path, int] = {}
    while True:
        finished = done()
        for path in find():
            offsets.setdefault(path, 0)
        for path, text in _new_text(offsets):
            out.write("".join(f"{path.stem}: {line}\n" for line in text.splitlines()))
        out.flush()
        if finished:
            return
        time.sleep(interval)


def _new_text(offsets: dict[Path, int]) -> Iterator[tuple[Path, str]]:
    for path, offset in offsets.items():
        if not path.is_file():
            continue
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
        # Only whole lines: a line still being written is printed once it ends.
        end = data.rfind(b"\n") + 1
        offsets[path] = offset + end
        if end:
            yield path, data[:end].decode(errors="replace")
