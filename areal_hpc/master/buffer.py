"""The master's sample buffer: metadata only (where each key of a sample lives), never the data itself.

A call may run on n samples once n buffered samples hold all its input keys and it has not consumed them;
the oldest samples (birth time) go first. A sample is freed when every call of the graph has consumed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from areal_hpc.master.graph import DATASET_KEYS, MFC

KeyRef = tuple[str, int]  # (batch file, index of the sequence in that file)


@dataclass
class SampleMeta:
    """What the master knows of one sequence: identity, size, age, and where each of its keys is stored."""

    sample_id: str
    group: str  # samples of one prompt share a group (GRPO)
    seqlen: int
    birth_time: float
    keys: dict[str, KeyRef] = field(default_factory=dict)
    consumed_by: set[str] = field(default_factory=set)


class Buffer:
    """Samples waiting for the calls of one graph."""

    def __init__(self, mfcs: Iterable[MFC]):
        self.mfcs = {m.name: m for m in mfcs}
        self._samples: dict[str, SampleMeta] = {}

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, samples: Iterable[SampleMeta]) -> None:
        """Put new samples in; an id already buffered is an error (it would be trained on twice)."""
        for sample in samples:
            if sample.sample_id in self._samples:
                raise ValueError(f"sample {sample.sample_id!r} is already in the buffer")
            self._samples[sample.sample_id] = sample

    def ready(self, mfc_name: str, n: int) -> list[SampleMeta] | None:
        """The n oldest samples that `mfc_name` can run on now, or None while there are fewer."""
        mfc = self.mfcs[mfc_name]
        needed = [k for k in mfc.inputs if k not in DATASET_KEYS]
        candidates = [
            s
            for s in self._samples.values()
            if mfc_name not in s.consumed_by and all(k in s.keys for k in needed)
        ]
        if len(candidates) < n:
            return None
        return sorted(candidates, key=lambda s: (s.birth_time, s.sample_id))[:n]

    def amend(self, sample_ids: list[str], path: str, keys: Iterable[str]) -> None:
        """Record that file `path` holds `keys` of these samples, the i-th sample at index i."""
        keys = list(keys)
        for index, sample_id in enumerate(sample_ids):
            sample = self._samples[sample_id]
            for key in keys:
                sample.keys[key] = (path, index)

    def consume(self, mfc_name: str, sample_ids: Iterable[str]) -> list[str]:
        """Mark the samples consumed by a call; returns the ids freed because every call has consumed them."""
        freed = []
        for sample_id in sample_ids:
            sample = self._samples[sample_id]
            sample.consumed_by.add(mfc_name)
            if sample.consumed_by >= set(self.mfcs):
                freed.append(sample_id)
                del self._samples[sample_id]
        return freed
