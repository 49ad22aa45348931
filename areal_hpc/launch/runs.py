"""Submitted runs as a user sees them: find, list, stop, logs (`areal-hpc list|stop|logs`; status: run_status)."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import yaml

from areal_hpc.config import ExperimentConfig, load_config
from areal_hpc.control import RunDir, fsio, get_status, user_root
from areal_hpc.launch import processes, slurm

DEFAULT_FILEROOT = ExperimentConfig().cluster.fileroot
SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # in a checkout


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
    - nothing: every run under the fileroots (`fileroots`).
    `fileroot`, when given, wins over the config's; the default is cluster.fileroot's."""
    if args and not is_config(args):
        if len(args) > 1:
            raise RunNotFound(f"give one run, not {len(args)}: {' '.join(args)}")
        return [find_run(args[0], fileroot)]
    if not args:
        return list_runs(*fileroots(fileroot))
    cfg = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
    runs = [
        r for r in list_runs(fileroot or cfg.cluster.fileroot) if r.root.parent.name == cfg.experiment_name
    ]
    return [r for r in runs if cfg.trial_name in (None, r.root.name)]


def fileroots(fileroot: str | None = None) -> list[str]:
    """Where runs are looked for when no config says: `fileroot` if given, else cluster.fileroot's default and
    the fileroots of the shipped configs (the toys' `runs`, under the working directory)."""
    if fileroot:
        return [fileroot]
    configs = [yaml.safe_load(p.read_text()) or {} for p in sorted(SHIPPED_CONFIGS.glob("*.yaml"))]
    shipped = [(c.get("cluster") or {}).get("fileroot") for c in configs]
    return list(dict.fromkeys([DEFAULT_FILEROOT, *filter(None, shipped)]))


def searched(fileroot: str | None = None) -> str:
    """The folders `fileroots` stands for, to say where runs were looked for."""
    return ", ".join(str(user_root(f)) for f in fileroots(fileroot))


def find_run(name: str, fileroot: str | None = None) -> RunDir:
    """A run directory given as a path, or as `experiment/trial` under `<fileroot>/<user>` of `fileroots`."""
    for candidate in [RunDir(Path(name))] + [RunDir(user_root(f) / name) for f in fileroots(fileroot)]:
        if candidate.config.is_file():
            return RunDir(candidate.root.resolve())
    raise RunNotFound(f"no run {name!r}: give its directory, or experiment/trial under {searched(fileroot)}")


def list_runs(*roots: str) -> list[RunDir]:
    """Every run under `<fileroot>/<user>` of each fileroot (default: DEFAULT_FILEROOT), oldest first."""
    folders = dict.fromkeys(user_root(f) for f in roots or [DEFAULT_FILEROOT])
    runs = [RunDir(p) for folder in folders for p in folder.glob("*/*")]
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
        raise RunNotFound(f"{run.root} has no Slurm jobs (a local run stops with stop_local)")
    slurm.cancel(ids)
    return slurm.wait_final(ids, timeout)


def stop_local(run: RunDir, timeout: float = 60.0) -> str:
    """SIGTERM the `areal-hpc run` of a local run, found by its record in the run directory, which stops every
    role as Ctrl-C does; once it exited, what was stopped. A process that took its pid since is left alone."""
    try:
        record = fsio.read_json(run.launcher)
    except ValueError:
        record = "not JSON"
    if record is None:
        raise RunNotFound(f"{run.root} has no Slurm jobs, and no `areal-hpc run` runs it ({state(run)})")
    if not processes.is_identity(record):  # the run directory is shared: nothing in it is signalled unread
        raise RunNotFound(f"{run.launcher} is not a launcher's record ({str(record)[:200]}): remove it if no "
                          f"`areal-hpc run` runs {run.root}")  # fmt: skip
    launcher = f"launcher {record['pid']} on {record['host']}"
    if record["host"] != socket.gethostname():
        raise RunNotFound(f"{run.root} is run by {launcher}: run `areal-hpc stop` there")
    if not processes.running(record):
        return f"{launcher}: not running (it ended without removing its record)"
    os.kill(record["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while processes.running(record):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{launcher} still runs {timeout:g} s after SIGTERM")
        time.sleep(0.1)
    return f"{launcher}: stopped; the run is {state(run)}"


def state(run: RunDir) -> str:
    status = get_status(run)
    return status.state if status else "not started"


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
