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
"""

from __future__ import annotations

import os
import time
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
