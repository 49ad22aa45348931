"""A trainer's recover checkpoint: sharded over the ranks that wrote it, loaded by another number of ranks
(2 -> 1, 1 -> 2), weights bit for bit and the optimizer state with them (the next step is the same)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.config import MicroBatchSpec
from areal_hpc.control import verify_snapshot, write_manifest
from areal_hpc.train import TrainerHandlers, dist
from areal_hpc.train.microbatch import micro_batches

TOKENS = np.random.default_rng(0).integers(3, 1000, 64)
CU = np.arange(0, 65, 8)  # eight sequences of eight tokens


def nll(out, mb):
    return -out["logprobs"].sum() / 64


def step(handlers: TrainerHandlers) -> None:
    """One optimizer step on the eight sequences, split over the ranks."""
    rank, world = handlers.rank, handlers.world_size
    seqs = np.array_split(np.arange(8), world)[rank]
    cu = np.concatenate([[0], np.cumsum(np.diff(CU)[seqs])])
    ids = np.concatenate([TOKENS[CU[i] : CU[i + 1]] for i in seqs])
    batch = {"cu_seqlens": cu, "packed_input_ids": ids}
    handlers.engines["actor"].train_minibatch(micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=16)), nll)


def _rank(rank: int, world: int, cfg, phase: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, Path(out) / f"init-{phase}", backend="gloo", timeout_s=120)
    handlers = TrainerHandlers(cfg, rank, world)
    try:
        handlers.initialize({"total_train_steps": 4})
        if phase == "save":
            step(handlers)
            handlers.recover_save({"dir": folder})
            files = handlers.recover_wait(None)["files"]
            (Path(out) / f"files{rank}.json").write_text(json.dumps(files))
        else:
            handlers.recover_load({"dir": folder})
        weights = {name: t.clone() for name, t in handlers.engines["actor"].hf_weights()}
        step(handlers)  # the next step: the same only if the optimizer state came back
        after = {name: t.clone() for name, t in handlers.engines["actor"].hf_weights()}
        torch.save({"weights": weights, "after": after}, Path(out) / f"{phase}{rank}.pt")
        dist.barrier()  # no rank leaves while another's last collective is in flight
    finally:
        handlers.saver.close() if handlers.saver else None
        dist.destroy()


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(toy, tmp_path, saved_by, loaded_by):
    cfg = toy.config("reshard", 4, "actor.dtype=float32", "actor.optimizer.warmup_steps_proportion=0")
    folder = tmp_path / "ckpt"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(saved_by, cfg, "save", str(folder), str(tmp_path)), nprocs=saved_by)
    known = {
        k: v
        for r in range(saved_by)
        for k, v in json.loads((tmp_path / f"files{r}.json").read_text()).items()
    }
    manifest = write_manifest(folder, known=known)
    verify_snapshot(folder)  # the entries the ranks hashed as they wrote are the files' own
    state_bytes = sum(t.numel() * 4 * 3 for t in torch.load(tmp_path / "save0.pt")["weights"].values())
    shards = sum(e["size"] for name, e in manifest["files"].items() if name.startswith("shards/"))
    assert state_bytes <= shards < 1.1 * state_bytes  # one copy of weights and Adam's two moments
    mp.spawn(_rank, args=(loaded_by, cfg, "load", str(folder), str(tmp_path)), nprocs=loaded_by)

    saved, loaded = torch.load(tmp_path / "save0.pt"), torch.load(tmp_path / "load0.pt")
    for name, tensor in saved["weights"].items():
        torch.testing.assert_close(loaded["weights"][name], tensor, atol=0, rtol=0)
        torch.testing.assert_close(loaded["after"][name], saved["after"][name], atol=1e-6, rtol=0)
