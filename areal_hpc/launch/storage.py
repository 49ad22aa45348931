"""What a run needs of its storage, probed before anything is written (docs/cluster.md says it in full):
the file root takes an atomic rename over an existing file (every shared file of a run is written that way)
and has room for the run's recover checkpoints and weight snapshots; under `areal-hpc run`, this machine's
/dev/shm has room for the trainers' checkpoint buffers. No file lock is needed anywhere (the trainers meet
over TCP, HDF5 files are opened without locks), so flock is not probed.

    problems = storage_problems(cfg, here=True)   # [] or messages naming the option and the path
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from areal_hpc.config import ExperimentConfig

GB = 1e9
RECOVER_BYTES = 12  # per trained parameter: float32 weights and Adam's two moments (docs/troubleshooting.md)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # "all-linear"
SNAPSHOT_BYTES = 2  # per parameter: a bf16 weight snapshot (weight_update_mode disk)
SHM = Path("/dev/shm")


def storage_problems(cfg: ExperimentConfig, here: bool) -> list[str]:
    root = existing_ancestor(Path(cfg.cluster.fileroot).expanduser().resolve())
    out = [f"'cluster.fileroot': {p}" for p in rename_problems(root)]
    dims = _dims(cfg.actor.path)
    if dims is None:  # no readable config.json: the model's own check says why
        return out
    params, trained = _total(dims), _trained(dims, cfg.actor.lora)
    needed, what = needed_bytes(cfg, params, trained)
    free = shutil.disk_usage(root).free
    if free < needed:
        out.append(
            f"'cluster.fileroot': {root} has {free / GB:.1f} GB free, but the run needs about {needed / GB:.1f} GB "
            f"({what}): free some, lower recover_keep, or choose another file root"
        )
    if here and cfg.recover_mode != "disabled" and SHM.is_dir():  # all trainer ranks on this machine
        shm_free, buffers = shutil.disk_usage(SHM).free, RECOVER_BYTES * trained
        if shm_free < buffers:
            out.append(
                f"{SHM} has {shm_free / GB:.1f} GB free, but the trainers' recover checkpoint buffers take "
                f"{buffers / GB:.1f} GB: enlarge it, or set recover_mode=disabled"
            )
    return out


def existing_ancestor(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where the run directory will be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def rename_problems(folder: Path) -> list[str]:
    """Whether `folder` takes a file written to a temporary name and renamed over an existing one."""
    probe, tmp = folder / f".areal-probe-{os.getpid()}", folder / f".areal-probe-{os.getpid()}.tmp"
    try:
        probe.write_text("old")
        tmp.write_text("new")
        os.replace(tmp, probe)
        if probe.read_text() != "new" or tmp.exists():
            return [f"{folder} does not replace a file atomically by rename"]
    except OSError as exc:
        return [f"{folder} cannot hold the run directory: writing and renaming a file there failed: {exc}"]
    finally:
        for path in (probe, tmp):
            with contextlib.suppress(OSError):
                path.unlink()
    return []


def needed_bytes(cfg: ExperimentConfig, params: int, trained: int) -> tuple[int, str]:
    """Bytes the file root needs at once: recover checkpoints of the ``trained`` parameters (those kept and one
    being written) and weight snapshots of all ``params`` (the one served and the next)."""
    parts = []
    if cfg.recover_mode != "disabled":
        parts.append(
            (RECOVER_BYTES * trained * (cfg.recover_keep + 1), f"{cfg.recover_keep + 1} recover checkpoints")
        )
    if cfg.experiment_type == "ppo" and cfg.weight_update_mode == "disk":
        parts.append((SNAPSHOT_BYTES * params * 2, "2 weight snapshots"))
    return sum(n for n, _ in parts), ", ".join(w for _, w in parts) or "no checkpoint"


def trained_parameter_count(cfg: ExperimentConfig) -> int | None:
    """The actor's parameters a recover checkpoint holds: all of them, or with actor.lora its adapters only
    (the base is the model's path, never changed)."""
    dims = _dims(cfg.actor.path)
    return None if dims is None else _trained(dims, cfg.actor.lora)


def parameter_count(model: str | None) -> int | None:
    """About how many parameters a decoder-only model of a Hugging Face config.json has, or None."""
    dims = _dims(model)
    return None if dims is None else _total(dims)


def _trained(dims: dict, lora) -> int:
    if not lora.rank:
        return _total(dims)
    modules = (
        LINEAR if "all-linear" in lora.target_modules else [m for m in lora.target_modules if m in LINEAR]
    )
    return dims["layers"] * lora.rank * sum(sum(dims[m]) for m in modules)


def _total(dims: dict) -> int:
    return dims["layers"] * sum(a * b for a, b in (dims[m] for m in LINEAR)) + dims["embeddings"]


def _dims(model: str | None) -> dict | None:
    """(inputs, outputs) of each linear module of a layer, the layers and the embeddings' parameters of a
    decoder-only model's config.json; None if there is none readable, or a dimension is not a positive integer
    (the model's loading names such a file; the storage check then sizes nothing)."""
    try:
        hf = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    if not isinstance(hf, dict):
        return None

    def count(key: str, default: object = None) -> int | None:
        value = hf.get(key, default)
        return value if type(value) is int and value > 0 else None

    h, layers, vocab = count("hidden_size"), count("num_hidden_layers"), count("vocab_size")
    heads = count("num_attention_heads", 1)
    kv_heads, inter = count("num_key_value_heads", heads), count("intermediate_size", 4 * (h or 0))
    if None in (h, layers, vocab, heads, kv_heads, inter):
        return None
    q, kv = h, h // heads * kv_heads
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        "layers": layers, "embeddings": vocab * h * (1 if hf.get("tie_word_embeddings") else 2),
    }  # fmt: skip
