"""What `areal-hpc status` shows of a run, once or live (`--watch`): Slurm components, the run's state, its
roles' heartbeats, step, reward and ETA, rollouts in flight and staleness, the last checkpoints.

Everything is read from the run directory (and sacct), so it works from a login node while the run goes on.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from areal_hpc.control import RunDir, fsio, get_status, last_beat
from areal_hpc.launch import runs, slurm
from areal_hpc.monitor import format_secs, progress_line, read_stats
from areal_hpc.recover import Checkpoints

SILENT_SECS = 30.0  # a heartbeat older than this is shown as silent (roles beat every second)
HEAD = "ppo_actor/head_offpolicyness"


def status_rows(run: RunDir) -> list[tuple[str, str]]:
    """(what, value) rows, from the Slurm components down to the last checkpoints."""
    rows = []
    for job in runs.slurm_jobs(run):
        states = slurm.component_states(job["job_id"])
        for (component_id, state), name in zip(sorted(states.items()), job["components"], strict=False):
            rows.append((f"slurm job {component_id} ({name})", state))
        if not states:
            rows.append((f"slurm job {job['job_id']}", "not known to sacct yet"))
        if slurm.stuck(states):
            rows.append(
                ("stuck", f"it never starts again; requeue it: areal-hpc submit --recover {run.root}")
            )
    status = get_status(run)
    why = f" ({status.role}: {status.reason})" if status and status.reason else ""
    rows.append(("run", f"{status.state}{why}" if status else "not started"))
    rows.append(("roles", roles_line(run)))
    if progress := fsio.read_json(run.progress):
        rows.append(("progress", progress_line(progress)))
    if generation := fsio.read_json(run.generation):
        rows += generation_rows(generation, last_step_stats(run))
    rows.append(("recover checkpoint", recover_line(run)))
    rows.append(("saved checkpoint", saved_line(run)))
    return rows


def status_lines(run: RunDir) -> list[str]:
    return [f"run {run.root}"] + [f"  {what}: {value}" for what, value in status_rows(run)]


def roles_line(run: RunDir, now: float | None = None) -> str:
    """How many roles beat, and which are silent or stopped (a run of hundreds lists only those)."""
    now = time.time() if now is None else now
    names = sorted(p.stem for p in run.heartbeats.glob("*.json"))
    beats = {name: last_beat(run.heartbeats, name) for name in names}
    stopped = [n for n, b in beats.items() if b and b.get("state") == "stopped"]
    silent = [f"{n} {now - b['time']:.0f} s" for n, b in beats.items() if b and n not in stopped
              and now - b["time"] > SILENT_SECS]  # fmt: skip
    if not names:
        return "none has started"
    parts = [f"{len(names) - len(stopped) - len(silent)} of {len(names)} alive"]
    parts += [f"silent: {', '.join(silent)}"] * bool(silent) + [f"stopped: {', '.join(stopped)}"] * bool(
        stopped
    )
    return "; ".join(parts)


def generation_rows(g: dict, last: dict) -> list[tuple[str, str]]:
    """Asynchronous RL: rollouts in flight, and how stale the newest may be against the servers' weights."""
    head = ""
    if f"{HEAD}/avg" in last:
        head = (
            f"; last step's samples {last[f'{HEAD}/avg']:.1f} versions behind (max {last[f'{HEAD}/max']:.0f})"
        )
    return [
        ("rollouts in flight", f"{g['running']} (at most {g['max_concurrent']}); "
                               f"{g['accepted']} accepted, {g['dropped']} dropped"
                               f"{waiting(g.get('waiting_samples', 0))}"),
        ("staleness", f"servers hold weight version {g['version']}; new rollouts aim at version "
                      f"{g['expected_version']} (bound {g['version'] + g['bound']}){head}"),
    ]  # fmt: skip


def waiting(samples: int) -> str:
    """Samples held back until a server has room for them (gen.client.Admission)."""
    return f"; {samples} samples waiting for a server slot" if samples else ""


def last_step_stats(run: RunDir) -> dict:
    steps = [r for r in read_stats(run.stats) if f"{HEAD}/avg" in r]
    return steps[-1] if steps else {}


def recover_line(run: RunDir) -> str:
    """The newest recover checkpoint (by name: checking its files is the resuming controller's job)."""
    ckpts = Checkpoints(run.recover)
    steps = ckpts.steps()
    if not steps:
        return "none yet"
    path = ckpts.path(steps[-1])
    return f"global step {steps[-1]}, written {_age(path)} ago ({path})"


def saved_line(run: RunDir) -> str:
    """The newest persistent (HF) checkpoint of the actor."""
    saved = list(run.saved_checkpoints("actor").values())
    return f"{saved[-1]}, written {_age(saved[-1])} ago" if saved else "none yet"


def _age(path: Path) -> str:
    return format_secs(time.time() - path.stat().st_mtime)


def status_table(run: RunDir) -> Table:
    table = Table(title=str(run.root), show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    for what, value in status_rows(run):
        table.add_row(what, value)
    return table


def watch(run: RunDir, interval: float = 2.0, console: Console | None = None) -> None:
    """Redraw the status table every `interval` seconds until the run is over (COMPLETE or ABORTED)."""
    with Live(status_table(run), console=console, auto_refresh=False) as live:
        while not ((status := get_status(run)) and status.final):
            time.sleep(interval)
            live.update(status_table(run), refresh=True)
        live.update(status_table(run), refresh=True)
