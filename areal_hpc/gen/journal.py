"""Each episode's completed generations, kept in the run directory, so that an episode cut short by a crash, a
preemption or a requeue resumes at its last completed turn instead of starting over.

An episode is known by (epoch, prompt, index in its group): a resumed run draws the same prompt in the same epoch
again, and its episodes find their journals. Each completed generation is one line, appended with one write and
fsync'd, so a crash can only tear the last line (skipped on reading). A line holds the key of its request (the
context ids, the sampling parameters and the stop strings, hashed) and the answer: sampled ids, behaviour
logprobs, weight versions and finish reason, and under routing replay its routed experts (gen.routing: the
compact array as it is, 1-2 bytes an expert id), so that a replayed episode packs the same batch.

On resume the episode's requests are answered from its journal as long as each one's key equals the recorded
one's: the same tokens, no generation. From the first request that differs the episode generates live, and the
journal is cut there (a warning names the episode and the request). A group's journals are removed once the group
is stored or dropped: the ledger and the rollout store keep it exactly once from there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from areal_hpc.control import fsio

logger = logging.getLogger("rollout")
KEY = re.compile(r"[0-9a-f]{64}")  # request_key's
FINISH = ("stop", "length")


@dataclass(frozen=True)
class Entry:
    """One completed generation: its request's key and its answer."""

    key: str
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str
    routing: np.ndarray | None = field(default=None, compare=False, repr=False)  # routing replay's

    def line(self) -> bytes:
        fields = {
            "key": self.key,
            "ids": _pack(self.ids, "<i4"),
            "logprobs": _pack(self.logprobs, "<f8"),  # float64: a replay gives the very numbers
            "versions": _pack(self.versions, "<i4"),
            "finish": self.finish,
        }
        if self.routing is not None:
            fields["routing"] = _pack_array(self.routing)
        return (json.dumps(fields) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> Entry:
        """The entry of one line; ValueError (or KeyError, TypeError) when its fields do not add up: a line
        torn by a crash, or written by something else, is never half taken."""
        raw = json.loads(line)
        entry = cls(
            raw["key"],
            _unpack(raw["ids"], "<i4"),
            _unpack(raw["logprobs"], "<f8"),
            _unpack(raw["versions"], "<i4"),
            raw["finish"],
            _unpack_array(raw["routing"]) if "routing" in raw else None,
        )
        if not (isinstance(entry.key, str) and KEY.fullmatch(entry.key)):
            raise ValueError("the key is not a request's hash")
        if not len(entry.ids) == len(entry.logprobs) == len(entry.versions):
            raise ValueError(
                f"{len(entry.ids)} ids, {len(entry.logprobs)} logprobs, {len(entry.versions)} versions"
            )
        if entry.finish not in FINISH or min(entry.ids + entry.versions, default=0) < 0:
            raise ValueError("a finish reason, an id or a version that no generation gives")
        return entry


def request_key(ids: Sequence[int], params: dict, stop: Sequence[str] = ()) -> str:
    """What identifies a request: its context ids, sampling parameters and stop strings."""
    digest = hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes())
    digest.update(json.dumps([params, list(stop)], sort_keys=True).encode())
    return digest.hexdigest()


class Journal:
    """One episode's journal (``name`` in logs and warnings; ``about``: what its group's folder is, written
    there as id.json when the folder is made, since the folder's name is a hash)."""

    def __init__(self, path: Path, name: str, about: dict | None = None):
        self.path, self.name, self.about = path, name, about
        self.entries, good = read_entries(path)
        if path.exists() and path.stat().st_size > good:  # a torn last line: appends go after the good ones
            os.truncate(path, good)
        self.replayed = 0  # the recorded generations answered so far
        self.mismatched = False

    def replay(self, key: str) -> Entry | None:
        """The recorded answer to the next request when it has this key; None when it is new or differs (then
        every later recorded one is dropped, and the episode generates live from here)."""
        if self.replayed >= len(self.entries):
            return None
        entry = self.entries[self.replayed]
        if entry.key == key:
            self.replayed += 1
            return entry
        logger.warning(
            "episode %s: request %d differs from the one recorded before the restart; it and the %d after it "
            "are generated live (the agent must ask the same things again: docs/agents.md)",
            self.name, self.replayed + 1, len(self.entries) - self.replayed - 1,
        )  # fmt: skip
        self.entries = self.entries[: self.replayed]
        fsio.write_bytes(self.path, b"".join(e.line() for e in self.entries), fsync=True)
        self.mismatched = True
        return None

    def append(self, entry: Entry) -> None:
        """Record a live generation: one write, fsync'd."""
        if self.replayed < len(self.entries):  # asked past the record without a mismatch: cannot happen
            raise RuntimeError(f"episode {self.name}: appended before its record was replayed")
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fsio.write_json(self.path.parent / "id.json", self.about or {})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, entry.line())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.entries.append(entry)
        self.replayed += 1


def read_entries(path: Path) -> tuple[list[Entry], int]:
    """The complete lines of a journal (none when it does not exist) and their length in bytes; a torn last
    line is left out."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    entries, good = [], 0
    for line in data.split(b"\n")[:-1]:  # the part after the last newline is torn or empty
        try:
            entries.append(Entry.parse(line))
        except (ValueError, KeyError, TypeError, RecursionError):
            break  # a line cut by a crash: nothing after it was acknowledged
        good += len(line) + 1
    return entries, good


class Journals:
    """The run's episode journals: ``root``/epoch<E>/<group>/<index>.jsonl, where <group> is the prompt id's
    ``fsio.name_of`` (no id can name another folder) and <group>/id.json holds the id itself."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def group(self, epoch: int, query_id: str) -> Path:
        return self.root / f"epoch{epoch}" / fsio.name_of(query_id)

    def episode(self, epoch: int, query_id: str, index: int) -> Journal:
        path = self.group(epoch, query_id) / f"{index}.jsonl"
        return Journal(path, f"{query_id}#{index} (epoch {epoch})", {"query_id": query_id, "epoch": epoch})

    def remove_group(self, epoch: int, query_id: str) -> None:
        """Once the group is stored or dropped: nothing of it is generated again."""
        shutil.rmtree(self.group(epoch, query_id), ignore_errors=True)

    def prune(self, used: dict[int, set[str]]) -> int:
        """Remove the journals of groups already used (stored, trained or dropped: a crash came between that and
        the removal); the number removed."""
        n = 0
        for epoch, ids in used.items():  # the folders there are few; the used ids many, and hashed in memory
            names = {fsio.name_of(query_id) for query_id in ids}
            for name in set(fsio.list_names(self.root / f"epoch{epoch}")) & names:
                shutil.rmtree(self.root / f"epoch{epoch}" / name, ignore_errors=True)
                n += 1
        return n


def _pack(values: Sequence, dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def _unpack(text: str, dtype: str) -> list:
    return np.frombuffer(base64.b64decode(text), dtype=dtype).tolist()


def _pack_array(array: np.ndarray) -> dict:
    """An array of any shape and dtype, as its little-endian bytes with both."""
    dtype = array.dtype.newbyteorder("<")
    data = base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode()
    return {"shape": list(array.shape), "dtype": dtype.str, "data": data}


def _unpack_array(packed: dict) -> np.ndarray:
    array = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.dtype(packed["dtype"]))
    return array.reshape(packed["shape"]).astype(array.dtype.newbyteorder("="))
