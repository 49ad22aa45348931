"""File primitives for the run directory on shared storage (NFS, Lustre, local disk).

Rules every control module follows:
- a file is written under a temporary name in its own folder and renamed into place (``os.replace``), so a
  reader sees the old content or the new one, never half of it; temporary names start with ``.`` and are
  skipped by every listing here;
- an operation that fails with ``ESTALE`` (an NFS handle gone stale under us) is retried a few times;
- a file that vanishes while we read it is simply absent.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ESTALE_RETRIES = 5
ESTALE_SLEEP = 0.01  # seconds, doubled after each stale attempt
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@=+-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
READABLE_CHARS = 40  # of an outside string kept in its file name, before the hash


def retry_estale(fn: Callable[[], T], what: str | os.PathLike) -> T:
    """Call ``fn()``, retrying while it raises ``OSError(ESTALE)``; the last error names ``what``."""
    for attempt in range(ESTALE_RETRIES):
        try:
            return fn()
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
            if attempt == ESTALE_RETRIES - 1:
                raise OSError(
                    errno.ESTALE, f"stale file handle after {ESTALE_RETRIES} tries", str(what)
                ) from exc
            time.sleep(ESTALE_SLEEP * 2**attempt)
    raise AssertionError("unreachable")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _dumps(obj: Any, path: Path) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{path}: value is not JSON-serialisable: {exc}") from exc


def _write_tmp(path: Path, data: bytes, fsync: bool) -> Path:
    """Write ``data`` to a fresh temporary file next to ``path``, creating the folder when needed."""
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove(tmp)  # a full disk, a quota: no half-written file is left behind
        raise
    os.close(fd)
    return tmp


def write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False) -> None:
    """Atomically write ``obj`` as JSON to ``path`` (temporary file in the same folder, then rename)."""
    path = Path(path)
    write_bytes(path, _dumps(obj, path), fsync=fsync)


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """Atomically write ``data`` to ``path`` (temporary file in the same folder, then rename)."""
    path = Path(path)
    tmp = _write_tmp(path, data, fsync)
    try:
        retry_estale(lambda: os.replace(tmp, path), path)
    except BaseException:
        remove(tmp)
        raise


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The JSON value in ``path``, or ``default`` when the file does not exist (or vanished meanwhile)."""
    path = Path(path)

    def read() -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    data = retry_estale(read, path)
    if data is None:
        return default
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def remove(path: str | os.PathLike) -> bool:
    """Delete a file; True when this call deleted it, False when it was already gone."""
    try:
        retry_estale(lambda: os.unlink(path), path)
        return True
    except FileNotFoundError:
        return False


def temporary_dir(path: Path) -> Path:
    """An empty folder beside the folder ``path`` to build it in (``move_into_place`` gives it its name)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished folder ``tmp`` to ``path``: a reader sees the old folder or the new, never half."""
    if path.exists():  # a folder cannot be renamed over a non-empty one: move the old one aside first
        old = path.with_name(f".{path.name}.old{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def list_names(folder: str | os.PathLike) -> list[str]:
    """Sorted names in ``folder`` without temporary files; empty when the folder does not exist."""

    def ls() -> list[str]:
        try:
            return os.listdir(folder)
        except FileNotFoundError:
            return []

    return sorted(n for n in retry_estale(ls, folder) if not n.startswith("."))


def check_segment(name: str, what: str) -> str:
    """Return ``name`` if it is safe as one path component (letters, digits, ``_.:@=+-``, no leading dot)."""
    if not isinstance(name, str) or not _SEGMENT.fullmatch(name) or name.endswith(".json"):
        raise ValueError(
            f"{what} {name!r} is not a safe name: use letters, digits and _.:@=+- , start with a letter, "
            "digit or _, and do not end with .json"
        )
    return name


def name_of(text: str) -> str:
    """A file or folder name for an outside string (a dataset's prompt id): its first letters, digits, ``_``
    and ``-`` for the reader, then a hash of the whole, so no string can name ``.``, ``..``, a long name or
    another string's file."""
    digest = hashlib.sha256(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:24]
    readable = _UNSAFE.sub("_", str(text))[:READABLE_CHARS].strip("_")
    return f"{readable}-{digest}" if readable else digest
