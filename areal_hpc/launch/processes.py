"""The processes of a local run as Linux's /proc shows them: who a process is beyond its pid, and what its
roles leave running.

A pid is reused once its process is gone, so a record of the launcher in the run directory names it by
(host, boot, pid, start time), which no other process shares; `areal-hpc stop` signals only that process.
`areal-hpc run` adopts what its roles leave behind (Linux's child subreaper): a role killed in the middle of
its agent programs (each in a session of its own, out of the role's process group) leaves them to the
launcher, which kills them once the roles are stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
START_TIME = 19  # of /proc/<pid>/stat's fields after the command name: clock ticks after boot
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...); None when there is no such
    process. The name is cut at its last ')': it may hold spaces and parentheses."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def identity(pid: int) -> dict | None:
    """{"host", "boot", "pid", "start"}: equal for one process only, on any host, across reboots; None when
    there is no such process."""
    fields = _stat(pid)
    if fields is None:
        return None
    return {"host": socket.gethostname(), "boot": BOOT_ID.read_text().strip(), "pid": pid,
            "start": int(fields[START_TIME])}  # fmt: skip


def is_identity(record) -> bool:
    """Whether ``record`` has the form `identity` gives (a positive pid, so no process group is meant)."""
    return (
        isinstance(record, dict)
        and record.keys() == {"host", "boot", "pid", "start"}
        and all(isinstance(record[k], str) for k in ("host", "boot"))
        and all(isinstance(record[k], int) and not isinstance(record[k], bool) for k in ("pid", "start"))
        and record["pid"] > 0
    )


def running(record: dict) -> bool:
    """Whether the process `identity` recorded still runs (a zombie, ended but not waited for, does not)."""
    fields = _stat(record["pid"])
    return fields is not None and fields[0] != "Z" and identity(record["pid"]) == record


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """Within the block, the orphans of this process's descendants become its children (a child subreaper)
    instead of init's, where they could no longer be told from any other process."""
    if not sys.platform.startswith("linux"):
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int()
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before))
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, before.value)


def kill_adopted(own: set[int], within: float = 5.0) -> list[int]:
    """SIGKILL every child of this process but `own` (the children it started itself), each with its process
    group when it leads one (an agent program and what it started), until none is left or `within` seconds
    passed (a killed child's own orphans come next); the pids killed."""
    killed, deadline = [], time.monotonic() + within
    while (adopted := [p for p in children(os.getpid()) if p not in own]) and time.monotonic() < deadline:
        for pid in adopted:
            # A child's pid is not reused before it is waited for: that pid, and the group it leads, are its.
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            killed.append(pid)
    return killed
