"""The `slurm_cluster` fixture: a real Slurm cluster on loopback (tools/slurm_local/cluster.py), and helpers.

Which cluster: one already running at the user's root ($AREAL_SLURM_ROOT or /tmp/areal-slurm, as
`make slurm-up` makes it) is reused and left running, so a developer pays the start once. Otherwise the
fixture starts its own at `<that root>-test` on ports AREAL_SLURM_PORT_BASE + 50 (never the user's
cluster, never its ports) and stops it when the session ends; one still running there (a session that was
killed) is reused too and left alone. Starting one installs the Debian packages when they are missing (root).

Where no cluster can run (not root, packages missing and no apt-get) or the start fails, the tests that use
the fixture are skipped with the reason; AREAL_SLURM_REQUIRED=1 (CI) turns those skips into failures.

Every Slurm command needs `slurm_cluster.env()` (SLURM_CONF and PATH) in its environment: use
`slurm_cluster.run("sbatch", ...)`, or for submitit `monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))`.

The helpers below find the role processes of a run (the cluster's nodes are this machine's processes) and
follow a job through a requeue.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.slurm_local import cluster as slurm_local

CLUSTER_PY = Path(slurm_local.__file__)  # the command line: `python3 CLUSTER_PY up|down|status`
TEST_PORT_OFFSET = 50  # the user's cluster takes ports base + 0..13
# States after which a job does not run again by itself (sacct prints "CANCELLED by 0": first word).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
}  # fmt: skip


def own_root() -> Path:
    """Where the fixture starts its own cluster."""
    return Path(f"{slurm_local.default_root()}-test")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm_local.Cluster]:
    """A running local Slurm cluster: nodes n1-n4 (gpu:2 each), partitions gen, train, all, urgent."""
    for root in (slurm_local.default_root(), own_root()):
        if slurm_local.is_running(root):
            if not slurm_local.config_is_current(root):  # e.g. started before SlurmdTimeout was set
                warnings.warn(
                    f"the Slurm cluster at {root} runs an older slurm.conf than tools/slurm_local/templates: "
                    "requeue tests may be slow or time out; restart it (make slurm-down slurm-up)",
                    stacklevel=1,
                )
            yield slurm_local.Cluster(Path(root).absolute())
            return
    ok, reason = slurm_local.can_run()
    if not ok:
        _skip(reason)
    root = own_root()
    try:
        cluster = slurm_local.start(root, port_base=slurm_local.default_port_base() + TEST_PORT_OFFSET)
    except slurm_local.ClusterError as e:
        _skip(f"the local Slurm cluster did not start: {e}")
    try:
        yield cluster
    finally:
        slurm_local.stop(root)


def _skip(reason: str) -> None:
    if os.environ.get("AREAL_SLURM_REQUIRED") == "1":
        pytest.fail(f"AREAL_SLURM_REQUIRED=1 but: {reason}", pytrace=False)
    pytest.skip(reason)


def submit(cluster: slurm_local.Cluster, *args: str) -> str:
    """sbatch ARGS; returns the job id."""
    return cluster.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]


def wait_for_job(
    cluster: slurm_local.Cluster, job_id: str, rows: tuple[str, ...] | None = None, timeout: float = 60.0
) -> dict[str, str]:
    """Poll sacct until every row named in rows (default: the job itself) is in a final state.

    Returns sacct's rows, job id -> state. A hetjob has rows ID+0, ID+1, ...: pass them, because a fast
    hetjob may first show a single row ID.
    """
    rows = rows or (job_id,)
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State", check=False).stdout
        states = {row: state.split()[0] for row, state in (line.split("|") for line in out.splitlines())}
        if all(states.get(row) in FINAL_STATES for row in rows):
            return states
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: sacct rows {rows} not final after {timeout:.0f} s: {states}")
        time.sleep(0.2)


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    """Slurm's commands (sbatch, sacct, scancel) and submitit see the local cluster."""
    for key, value in slurm_cluster.env().items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def role_env(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def wait_role(run, role: str, attempt: int, timeout: float = 60.0) -> int:
    """pid of the `role` task (not its srun) of attempt `attempt` of `run` (a RunDir), once it runs."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in Path("/proc").iterdir():
            try:
                args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                env = role_env(int(proc.name))
            except (OSError, ValueError):
                continue
            ours = "areal_hpc.launch.roles" in args and role in args and str(run.root) in args
            if ours and Path(args[0]).name != "srun" and env.get("AREAL_ATTEMPT") == str(attempt):
                return int(proc.name)
        assert time.monotonic() < deadline, f"no {role} of attempt {attempt} within {timeout} s"
        time.sleep(0.2)


def start_requeued(cluster: slurm_local.Cluster, job_id: str, timeout: float = 150.0) -> None:
    """Wait until `job_id` was requeued and runs again.

    A requeued job may start once cred_expire (10 s) has passed; Slurm 22.05 starts a heterogeneous one only
    at slurmctld's next node ping, every SlurmdTimeout / 3 (10 s on the local cluster): about 11-21 s. The
    timeout leaves room for a cluster started before SlurmdTimeout was set (a ping every 100 s).
    """
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.run("scontrol", "show", "job", job_id).stdout
        if "JobState=RUNNING" in info and "Restarts=0" not in info:
            return
        assert time.monotonic() < deadline, f"job {job_id} not running again within {timeout} s:\n{info}"
        time.sleep(0.5)


def job_log(run, suffix: str) -> str:
    """The job script's own output (`out`) or errors (`err`) of `run`, every attempt appended."""
    return next((run.root / "slurm").glob(f"*_0_log.{suffix}")).read_text()
