"""File-based controller primitives: every role coordinates through the run directory alone.

fsio       atomic JSON writes (tmp + rename), ESTALE-retrying reads, safe names
poll       adaptive polling and ControlTimeout, the base of every timeout here
registry   Registry: key -> JSON value files under registry/, with TTLs and wait()
mailbox    Mailbox (caller) and Inbox (worker): request/reply files under mailbox/<worker>/
flush      the model worker's request kinds and the pure flush ordering
worker     WorkerServer / serve: a worker's request loop with blocking requests and hooks
heartbeat  Heartbeat thread and dead_workers()
status     status.json: RUNNING, COMPLETE, ABORTED (final)
ledger     Ledger: consumed sample ids per step in ledger.jsonl
"""

from areal_hpc.control.flush import BLOCKING, FLUSH, NON_BLOCKING, STOP, FlushStep, flush_plan
from areal_hpc.control.heartbeat import Heartbeat, dead_workers, last_beat
from areal_hpc.control.ledger import Ledger, LedgerRecord
from areal_hpc.control.mailbox import Inbox, Mailbox, RemoteError, ReplyTimeout, Request
from areal_hpc.control.poll import ControlTimeout
from areal_hpc.control.registry import KeyExistsError, Registry, RegistryTimeout
from areal_hpc.control.status import (
    ABORTED,
    COMPLETE,
    RUNNING,
    Status,
    StatusError,
    abort,
    complete,
    get_status,
    set_status,
)
from areal_hpc.control.worker import WorkerServer, WorkerStopped, serve

__all__ = [
    "ABORTED",
    "BLOCKING",
    "COMPLETE",
    "FLUSH",
    "NON_BLOCKING",
    "RUNNING",
    "STOP",
    "ControlTimeout",
    "FlushStep",
    "Heartbeat",
    "Inbox",
    "KeyExistsError",
    "Ledger",
    "LedgerRecord",
    "Mailbox",
    "Registry",
    "RegistryTimeout",
    "RemoteError",
    "ReplyTimeout",
    "Request",
    "Status",
    "StatusError",
    "WorkerServer",
    "WorkerStopped",
    "abort",
    "complete",
    "dead_workers",
    "flush_plan",
    "get_status",
    "last_beat",
    "serve",
    "set_status",
]
