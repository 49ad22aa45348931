"""Heartbeats: each role refreshes ``<folder>/<name>.json`` (``RunDir.heartbeats``) so that others can tell it is
alive.

The file holds ``{"pid": ..., "host": ..., "state": "alive" | "stopped", "started": <unix time>}``, written
once (tmp + rename); a beat only touches its mtime, one cheap metadata update instead of a new file, so a
thousand roles beating every second cost the shared storage little. Readers open the file before looking at
its mtime (NFS close-to-open gives fresh attributes). A role that ends cleanly writes ``stopped`` and is never
reported dead. Liveness compares the mtime (the storage's clock) with the reader's clock: keep timeouts well
above the skew between nodes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from areal_hpc.control import fsio

logger = logging.getLogger(__name__)


def heartbeat_path(folder: str | os.PathLike, name: str) -> Path:
    """The heartbeat file of role ``name`` in the heartbeat folder."""
    return Path(folder) / f"{fsio.check_segment(name, 'heartbeat name')}.json"


class Heartbeat:
    """A daemon thread beating every ``interval`` seconds. ``start()`` writes the first beat before returning.

    Use as ``with Heartbeat(run.heartbeats, "trainer0"): ...`` or call ``start()`` and ``stop()``.
    """

    def __init__(self, folder: str | os.PathLike, name: str, interval: float = 1.0) -> None:
        self.path = heartbeat_path(folder, name)
        self.name = name
        self.interval = interval
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, state: str | None = None) -> None:
        """Beat now; with ``state``, (re)write the file first ("alive" or "stopped")."""
        if state is None:
            try:
                fsio.retry_estale(lambda: os.utime(self.path), self.path)
                return
            except FileNotFoundError:
                state = "alive"  # the file was removed under us: write it again
        info = {"pid": os.getpid(), "host": socket.gethostname(), "state": state, "started": self.started}
        fsio.write_json(self.path, info)

    def start(self) -> Heartbeat:
        """Write the heartbeat file and start the background thread; returns self."""
        self.beat("alive")
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError as exc:  # a hiccup of shared storage must not kill the role; the next beat retries
                logger.warning("heartbeat %s: could not write %s: %s", self.name, self.path, exc)

    def stop(self) -> None:
        """Stop beating and mark the role as stopped cleanly, so it is not reported dead."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.beat("stopped")

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def last_beat(folder: str | os.PathLike, name: str) -> dict | None:
    """The heartbeat of ``name`` (pid, host, state, started) with ``time`` of the last beat; None if never."""
    path = heartbeat_path(folder, name)

    def read() -> dict | None:
        try:
            with open(path, "rb") as f:
                return {**json.loads(f.read()), "time": os.fstat(f.fileno()).st_mtime}
        except FileNotFoundError:
            return None

    return fsio.retry_estale(read, path)


def dead_workers(folder: str | os.PathLike, names: Iterable[str], timeout: float) -> list[str]:
    """Those of ``names`` whose last beat is older than ``timeout`` seconds or that never beat.

    A role that stopped cleanly is not dead.
    """
    now = time.time()
    dead = []
    for name in names:
        beat = last_beat(folder, name)
        if beat is None or (beat.get("state") != "stopped" and now - beat["time"] > timeout):
            dead.append(name)
    return dead
