"""Packed sample batches as HDF5 files in the run directory: the data plane between roles.

A batch of B sequences is stored packed: `cu_seqlens` (B+1, int64) gives the boundaries; per-token arrays
have length T = cu_seqlens[-1] and per-sequence arrays length B (the layout of `areal_hpc.algo.packing`).
Every sequence has at least two tokens (a prompt token and an answer token), so T > B and an array's
length alone says which kind it is. An array may have a shape of its own after that axis: routing replay's
`packed_routed_experts` is [T, layers, top_k] (uint8 or int16 expert ids, gen.routing); selecting, splitting and
gathering move whole rows, so every token keeps its own.
Files are written to a temporary name and renamed, so a reader never sees half a batch; nor do they need HDF5's
file lock, which NFS and Lustre often refuse ("unable to lock file"): every file is opened without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

CU = "cu_seqlens"
GROUPS = "group_ids"  # per sequence: its prompt's group, numbered within its file
ROUTED_EXPERTS = "packed_routed_experts"  # [T, layers, top_k]: row t = the experts of token t's forward
# Per-token keys with rows of their own shape, and their number of dimensions.
TOKEN_ROWS = {ROUTED_EXPERTS: 3}


class BatchError(ValueError):
    """A batch whose arrays do not fit its cu_seqlens, or a key or file that is not there."""


def _open(path: str | Path, mode: str) -> h5py.File:
    """An HDF5 file of the run directory, without HDF5's file lock (see the module's docstring)."""
    return h5py.File(path, mode, locking=False)


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_packed(arrays: Mapping[str, Any]) -> tuple[int, int]:
    """(B, T) of a packed batch; every array must be per-token (T) or per-sequence (B) along axis 0."""
    if CU not in arrays:
        raise BatchError(f"a packed batch needs '{CU}'; got keys {sorted(arrays)}")
    cu = _as_numpy(arrays[CU])
    if cu.ndim != 1 or len(cu) < 1 or cu[0] != 0 or np.any(np.diff(cu) < 2):
        raise BatchError(f"'{CU}' must start at 0 and grow by >= 2 tokens a sequence, got {cu[:8].tolist()}")
    n_seqs, n_tokens = len(cu) - 1, int(cu[-1])
    for key, value in arrays.items():
        length = _as_numpy(value).shape[0] if _as_numpy(value).ndim else None
        if key != CU and length not in (n_seqs, n_tokens):
            raise BatchError(
                f"'{key}' has length {length}; expected T={n_tokens} tokens or B={n_seqs} sequences"
            )
        if key in TOKEN_ROWS:
            _check_token_rows(key, _as_numpy(value), n_tokens)
    return n_seqs, n_tokens


def _check_token_rows(key: str, value: np.ndarray, n_tokens: int) -> None:
    """A key of TOKEN_ROWS: a row of integers per token."""
    if value.shape[0] != n_tokens or value.ndim != TOKEN_ROWS[key] or value.dtype.kind not in "iu":
        raise BatchError(
            f"'{key}' is {value.dtype} of shape {value.shape}; expected integers of {TOKEN_ROWS[key]} "
            f"dimensions, a row per token (T={n_tokens})"
        )


def write_batch(path: str | Path, arrays: Mapping[str, Any], attrs: Mapping[str, Any] | None = None) -> Path:
    """Write a packed batch atomically (tmp + rename); attrs are small JSON-like metadata."""
    check_packed(arrays)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with _open(tmp, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=_as_numpy(value))
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    os.replace(tmp, path)
    return path


def read_batch(
    path: str | Path, keys: Iterable[str] | None = None, seqs: Sequence[int] | None = None
) -> dict[str, np.ndarray]:
    """Arrays of a batch file (all keys, or `keys`), optionally only the sequences `seqs`, repacked."""
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"batch file {path} does not exist")
    with _open(path, "r") as f:
        wanted = list(f.keys()) if keys is None else [k for k in keys if k != CU]
        missing = [k for k in wanted if k not in f]
        if missing:
            raise BatchError(f"batch file {path} has no {missing}; it holds {sorted(f.keys())}")
        arrays = {k: f[k][()] for k in wanted}
        arrays[CU] = f[CU][()]
    return arrays if seqs is None else select(arrays, seqs)


def read_attrs(path: str | Path) -> dict[str, Any]:
    """The metadata of a batch file."""
    with _open(path, "r") as f:
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}


def select(arrays: Mapping[str, np.ndarray], seqs: Sequence[int]) -> dict[str, np.ndarray]:
    """The sequences `seqs` (in that order) of a packed batch, repacked with a new cu_seqlens."""
    n_seqs, n_tokens = check_packed(arrays)
    cu = np.asarray(arrays[CU], dtype=np.int64)
    seqs = np.asarray(seqs, dtype=np.int64)
    if len(seqs) and (seqs.min() < 0 or seqs.max() >= n_seqs):
        raise BatchError(f"sequence index out of range 0..{n_seqs - 1}: {seqs.tolist()[:8]}")
    token_idx = (
        np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs]) if len(seqs) else np.zeros(0, np.int64)
    )
    lengths = cu[seqs + 1] - cu[seqs]
    out = {CU: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    for key, value in arrays.items():
        if key == CU:
            continue
        out[key] = value[token_idx] if value.shape[0] == n_tokens else value[seqs]
    return out


def gather(refs: Mapping[str, Sequence[tuple[str, int]]]) -> dict[str, np.ndarray]:
    """A packed batch assembled from several files: `refs[key][i]` = (file, sequence index) of sample i.

    Reads each file once per key; per-token arrays of one sample must have the same length in every file.
    Group ids are renumbered over the batch (a file numbers its own groups).
    """
    n_samples = {len(v) for v in refs.values()}
    if len(n_samples) > 1:
        raise BatchError(f"every key needs one reference per sample; got counts {sorted(n_samples)}")
    out: dict[str, np.ndarray] = {}
    lengths: np.ndarray | None = None
    for key, key_refs in refs.items():
        pieces: list[np.ndarray | None] = [None] * len(key_refs)
        by_file: dict[str, list[int]] = {}
        for i, (path, _) in enumerate(key_refs):
            by_file.setdefault(path, []).append(i)
        for path, positions in by_file.items():
            part = read_batch(path, keys=[key], seqs=[key_refs[i][1] for i in positions])
            cu, values = part[CU], part[key]
            per_token = values.shape[0] == cu[-1]
            for j, i in enumerate(positions):
                pieces[i] = values[cu[j] : cu[j + 1]] if per_token else values[j : j + 1]
                if per_token:
                    length = cu[j + 1] - cu[j]
                    if lengths is None:
                        lengths = np.zeros(len(key_refs), dtype=np.int64)
                    if lengths[i] and lengths[i] != length:
                        raise BatchError(
                            f"'{key}' of sample {i} in {path} has {length} tokens, not {lengths[i]}"
                        )
                    lengths[i] = length
        out[key] = np.concatenate(pieces)
        if key == GROUPS:  # a file's group ids are its own: group 0 of two files are two groups
            found: dict[tuple[str, int], int] = {}
            pairs = zip((path for path, _ in key_refs), out[key].tolist(), strict=True)
            out[key] = np.asarray([found.setdefault(pair, len(found)) for pair in pairs], dtype=np.int64)
    if lengths is None:
        raise BatchError(f"gather needs at least one per-token key, got {sorted(refs)}")
    out[CU] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return out


def read_keys(path: str | Path) -> list[str]:
    """The keys a batch file holds."""
    with _open(path, "r") as f:
        return list(f.keys())
