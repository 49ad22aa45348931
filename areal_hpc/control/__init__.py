"""File-based coordination: every role meets the others through the run directory alone.

rundir     RunDir: every path of a run directory; create_run_dir, run_dir_of, default_trial_name
context    RunContext: what a role process knows of its run (config, allocation, its task)
fsio       atomic writes, JSON or bytes (tmp + rename), ESTALE-retrying reads, safe names
poll       adaptive polling and ControlTimeout, the base of every timeout here
manifest   the manifest (sizes, sha256) that marks a multi-file folder complete, and its check
mailbox    Mailbox (caller) and Inbox (worker): request/reply files per worker
flush      the model worker's request kinds and the pure flush ordering
worker     WorkerServer: a worker's request loop with blocking requests and hooks
heartbeat  Heartbeat thread, last_beat, dead_workers
status     status.json: RUNNING, COMPLETE, ABORTED (final); why_stop: is the run over for a serving role?
ledger     Ledger: consumed sample ids per step
timeline   every role's phases as events in a file of its own (span, instant); monitor/trace.py reads them
"""

from areal_hpc.control import fsio, timeline
from areal_hpc.control.context import LAUNCHER_ENV, SINGLE_ROLES, RunContext, task_name
from areal_hpc.control.heartbeat import Heartbeat, dead_workers, last_beat
from areal_hpc.control.ledger import Ledger, LedgerRecord
from areal_hpc.control.mailbox import Inbox, Mailbox, RemoteError, ReplyTimeout, Request
from areal_hpc.control.manifest import (
    MANIFEST,
    SnapshotError,
    read_manifest,
    sha256_file,
    snapshot_bytes,
    verify_snapshot,
    write_manifest,
)
from areal_hpc.control.poll import ControlTimeout, poll_until
from areal_hpc.control.rundir import RunDir, create_run_dir, default_trial_name, run_dir_of, user_root
from areal_hpc.control.status import (
    ABORTED,
    COMPLETE,
    EXIT_PERMANENT,
    RUNNING,
    START_TIMEOUT_SECS,
    RunEndedError,
    Status,
    StatusError,
    abort,
    complete,
    get_status,
    set_status,
    why_stop,
)
from areal_hpc.control.worker import WorkerServer

__all__ = [
    "MANIFEST",
    "ABORTED",
    "COMPLETE",
    "EXIT_PERMANENT",
    "LAUNCHER_ENV",
    "RUNNING",
    "SINGLE_ROLES",
    "START_TIMEOUT_SECS",
    "ControlTimeout",
    "Heartbeat",
    "Inbox",
    "Ledger",
    "LedgerRecord",
    "Mailbox",
    "RemoteError",
    "ReplyTimeout",
    "Request",
    "RunContext",
    "RunDir",
    "RunEndedError",
    "SnapshotError",
    "Status",
    "StatusError",
    "WorkerServer",
    "abort",
    "complete",
    "create_run_dir",
    "dead_workers",
    "default_trial_name",
    "fsio",
    "get_status",
    "last_beat",
    "poll_until",
    "read_manifest",
    "sha256_file",
    "run_dir_of",
    "set_status",
    "snapshot_bytes",
    "task_name",
    "timeline",
    "user_root",
    "verify_snapshot",
    "why_stop",
    "write_manifest",
]
