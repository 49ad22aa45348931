"""Data-parallel dispatch: split a call's samples over the ranks, balanced by tokens, groups kept whole."""

from __future__ import annotations

from areal_hpc.algo import balanced_partition
from areal_hpc.master.buffer import SampleMeta


def split_by_rank(samples: list[SampleMeta], n_ranks: int) -> list[list[SampleMeta]]:
    """n_ranks parts of balanced token count; the samples of one group (prompt) go to one rank (GRPO)."""
    groups: dict[str, list[SampleMeta]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample)
    members = list(groups.values())
    if len(members) < n_ranks:
        raise ValueError(f"{len(members)} prompt groups cannot be split over {n_ranks} data-parallel ranks")
    parts = balanced_partition([sum(s.seqlen for s in g) for g in members], n_ranks)
    return [[s for g in part for s in members[g]] for part in parts]


def refs_payload(samples: list[SampleMeta], keys: list[str]) -> dict[str, list[list]]:
    """{key: [[file, index], ...]} of the samples, the form a trainer rank reads with data.batch.gather."""
    return {key: [list(s.keys[key]) for s in samples] for key in keys}
