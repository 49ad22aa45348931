"""Registry: a key -> JSON value store on files under ``<run_dir>/registry/``.

A key is a ``/``-separated path of safe names, e.g. ``gen_servers/0``; its value lives in
``registry/gen_servers/0.json`` as ``{"value": ..., "expires": <unix time or null>, "ttl": <s or null>}``.
Keys with a TTL expire unless their owner calls ``keepalive`` in time; an expired entry reads as absent and
``gc()`` deletes it. TTLs compare wall clocks of different nodes, so keep them well above the clock skew.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

from areal_hpc.control import fsio
from areal_hpc.control.poll import ControlTimeout, poll_until

_MISSING = object()


class RegistryTimeout(ControlTimeout):
    """``Registry.wait`` gave up; the message names the key and how long it waited."""


class KeyExistsError(KeyError):
    """``Registry.add`` found the key already there (and ``replace`` was not given)."""


def _expired(entry: dict, now: float) -> bool:
    return entry.get("expires") is not None and entry["expires"] <= now


class Registry:
    """The registry of one run directory. Cheap to create; safe to use from many processes and nodes."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.root = Path(run_dir) / "registry"

    def path(self, key: str) -> Path:
        """The file holding ``key``; raises ValueError for an unsafe key (``..``, absolute, odd characters)."""
        if not isinstance(key, str) or not key or key.startswith("/"):
            raise ValueError(f"registry key {key!r} must be a relative path such as 'gen_servers/0'")
        parts = [fsio.check_segment(part, f"registry key {key!r}: part") for part in key.split("/")]
        return self.root.joinpath(*parts[:-1], parts[-1] + ".json")

    def _entry(self, key: str) -> dict | None:
        entry = fsio.read_json(self.path(key))
        return None if entry is None or _expired(entry, time.time()) else entry

    def add(self, key: str, value: Any, *, replace: bool = False, ttl: float | None = None) -> None:
        """Store ``value`` under ``key``; raises KeyExistsError if the key is present and not ``replace``.

        With ``ttl`` (seconds) the entry expires unless ``keepalive(key)`` is called within ``ttl``.
        """
        path = self.path(key)
        entry = {"value": value, "ttl": ttl, "expires": None if ttl is None else time.time() + ttl}
        if replace:
            fsio.write_json(path, entry)
            return
        for _ in range(2):
            if fsio.create_json(path, entry):
                return
            if self._entry(key) is not None or not self._reclaim_expired(path):
                break
        raise KeyExistsError(f"registry key {key!r} already exists ({path}); pass replace=True to overwrite")

    def _reclaim_expired(self, path: Path) -> bool:
        """Move an entry believed expired out of the way; False when the entry there turned out live.

        The entry is renamed to a private name first, so of two racing adders only one takes it away, and a
        live entry that a racer wrote meanwhile is put back instead of being deleted.
        """
        grave = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.expired")
        try:
            fsio.retry_estale(lambda: os.rename(path, grave), path)
        except FileNotFoundError:
            return True  # gone meanwhile: try creating again
        entry = fsio.read_json(grave)
        if entry is not None and not _expired(entry, time.time()):
            with contextlib.suppress(FileExistsError):  # a newer entry took the place: let it win
                os.link(grave, path)
            fsio.remove(grave)
            return False
        fsio.remove(grave)
        return True

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key``; ``default`` if absent or expired, or KeyError naming the key without one."""
        entry = self._entry(key)
        if entry is not None:
            return entry["value"]
        if default is _MISSING:
            raise KeyError(f"registry key {key!r} is absent ({self.path(key)})")
        return default

    def wait(self, key: str, timeout: float, poll: float = 0.05) -> Any:
        """Wait until ``key`` is present and return its value; RegistryTimeout names the key and the wait.

        ``poll`` is the longest sleep between looks (the first ones are much shorter).
        """
        self.path(key)  # check the key before waiting on it
        found = poll_until(
            lambda: self._entry(key),
            timeout,
            f"registry key {key!r} ({self.path(key)})",
            max_sleep=poll,
            error=RegistryTimeout,
        )
        return found["value"]

    def subtree(self, prefix: str = "") -> dict[str, Any]:
        """All live entries whose key is ``prefix`` or below it, as {full key: value}."""
        prefix = prefix.strip("/")
        base = self.path(prefix).with_suffix("") if prefix else self.root
        found: dict[str, Any] = {}
        if prefix and (entry := self._entry(prefix)) is not None:
            found[prefix] = entry["value"]
        now = time.time()
        for folder, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                key = name[: -len(".json")] if rel == "." else f"{rel}/{name[: -len('.json')]}"
                entry = fsio.read_json(Path(folder) / name)
                if entry is not None and not _expired(entry, now):
                    found[key] = entry["value"]
        return dict(sorted(found.items()))

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when it was there."""
        return fsio.remove(self.path(key))

    def keepalive(self, key: str) -> None:
        """Push back the expiry of a TTL'd ``key`` by its TTL; KeyError if it is absent or already expired."""
        entry = self._entry(key)
        if entry is None:
            raise KeyError(f"registry key {key!r} cannot be kept alive: absent or expired ({self.path(key)})")
        if entry.get("ttl") is not None:
            entry["expires"] = time.time() + entry["ttl"]
            fsio.write_json(self.path(key), entry)

    def gc(self) -> list[str]:
        """Delete expired entries; returns their keys."""
        removed = []
        now = time.time()
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                path = Path(folder) / name
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                entry = fsio.read_json(path)
                if entry is not None and _expired(entry, now) and self._reclaim_expired(path):
                    removed.append(path.relative_to(self.root).with_suffix("").as_posix())
        return sorted(removed)
