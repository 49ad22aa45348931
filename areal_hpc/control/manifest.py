"""The manifest that marks a multi-file folder on shared storage complete (a weight snapshot, an HF or a recover
checkpoint), and its check.

``manifest.json`` lists every other file of the folder with its size and sha256 and is written LAST (temporary
name, then rename): a folder without a valid manifest is incomplete or damaged, and readers refuse it with a
message naming the file at fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "areal_hpc.snapshot/1"
CHUNK = 8 * 1024 * 1024


class SnapshotError(RuntimeError):
    """A snapshot folder is incomplete or damaged; the message names the folder or file."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def snapshot_files(folder: Path) -> list[Path]:
    """The files of a snapshot: every regular file below ``folder`` but the manifest and hidden (temporary) ones."""
    files = []
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and rel.as_posix() != MANIFEST and not any(p.startswith(".") for p in rel.parts):
            files.append(path)
    return files


def write_manifest(
    folder: str | os.PathLike, extra: dict[str, Any] | None = None, known: dict[str, dict] | None = None
) -> dict:
    """Write ``folder/manifest.json`` (sizes and sha256 of every file), atomically; returns the manifest.

    ``known`` holds entries their writers hashed as they wrote (name -> size and sha256): those files are not
    read again, unless their size differs.
    """
    folder = Path(folder)
    known = known or {}
    files = {}
    for path in snapshot_files(folder):
        name, size = path.relative_to(folder).as_posix(), path.stat().st_size
        entry = known.get(name)
        files[name] = (
            entry if entry and entry["size"] == size else {"size": size, "sha256": sha256_file(path)}
        )
    manifest = {"format": FORMAT, "created": time.time(), **(extra or {}), "files": files}
    tmp = folder / f".{MANIFEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return manifest


def read_manifest(folder: str | os.PathLike) -> dict:
    """The manifest of ``folder``; SnapshotError if it is missing or not a manifest."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapshotError(
            f"{path} is missing: the snapshot is incomplete (its writer did not finish) or was not written "
            "by areal_hpc; refusing to load it"
        ) from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path} is not a valid manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path} is not a snapshot manifest (format {FORMAT!r} expected)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        raise SnapshotError(f"{path} is not a valid manifest: 'files' must map names to size and sha256")
    return manifest


def verify_snapshot(folder: str | os.PathLike, checksums: bool = True) -> dict:
    """Check ``folder`` against its manifest (presence, sizes, then sha256); returns the manifest.

    SnapshotError names the first file at fault: missing, of another size or content, or not listed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SnapshotError(f"snapshot folder {folder} does not exist")
    manifest = read_manifest(folder)
    listed = manifest["files"]
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            raise SnapshotError(f"{path} is listed in {folder / MANIFEST} but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise SnapshotError(f"{path} has {size} bytes, its manifest says {entry['size']}")
    extra = [p.relative_to(folder).as_posix() for p in snapshot_files(folder)]
    extra = [name for name in extra if name not in listed]
    if extra:
        raise SnapshotError(f"{folder / extra[0]} is not listed in {folder / MANIFEST}")
    if checksums:
        for name, entry in listed.items():
            if sha256_file(folder / name) != entry["sha256"]:
                raise SnapshotError(f"{folder / name}: sha256 differs from its manifest (damaged file)")
    return manifest


def snapshot_bytes(manifest: dict) -> int:
    """The bytes of a snapshot's files."""
    return sum(entry["size"] for entry in manifest["files"].values())
