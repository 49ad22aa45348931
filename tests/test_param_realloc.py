"""Parameter reallocation on four CPU gloo ranks: the actor trains at one layout (TP=2 x PP=2) and its copies at
other layouts take the trained weights, over torch.distributed or through the disk, and give its logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.alloc import ParallelSpec
from areal_hpc.config import mfc_spec
from areal_hpc.config.schema import MicroBatchSpec
from areal_hpc.data import CU, read_batch, write_batch
from areal_hpc.train import TrainerHandlers, dist
from areal_hpc.train.backends import make_engine
from tests.helpers import Toy
from tests.test_fsdp_engine import LENGTHS, packed

LAYOUTS = "allocation_mode=builtin.d1p1m1+actor_train:d1p2m2,actor_inf:d4p1m1"
COPIES = {"d2p1m2": ParallelSpec(2, 2, 1), "d2p2m1": ParallelSpec(2, 1, 2)}  # besides actor_inf's d4p1m1
SPEC = MicroBatchSpec(max_tokens_per_mb=16)


def refs(path: str, rows, keys=("packed_input_ids", "prompt_mask")) -> dict[str, list[list]]:
    return {key: [[path, int(i)] for i in rows] for key in keys}


def ppo_batch(logprobs: torch.Tensor, lengths=LENGTHS) -> dict[str, np.ndarray]:
    """An on-policy rollout of the packed sequences: groups of two, one answer right and one wrong."""
    n = len(lengths)
    return {
        **packed(lengths),
        "prompt_mask": np.zeros(sum(lengths), dtype=bool),
        "packed_logprobs": logprobs.numpy(),
        "proximal_logprobs": logprobs.numpy(),
        "rewards": np.where(np.arange(n) % 2 == 0, 5.0, -5.0).astype(np.float32),
        "seq_no_eos_mask": np.zeros(n, dtype=bool),
        "group_ids": np.arange(n) // 2,
    }


def _rank(rank: int, cfg, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, 4, f"{out}/init", backend="gloo", timeout_s=300)
    handlers = TrainerHandlers(cfg, rank, 4)
    try:
        handlers.initialize({"total_train_steps": 4, "mfcs": {"actor_train": "actor", "actor_inf": "actor"}})
        actor = handlers.engines["actor"]
        copies = {name: make_engine(cfg.actor, None, spec=spec) for name, spec in COPIES.items()}
        data = f"{out}/batch.h5"
        if rank == 0:
            write_batch(data, {**packed(), "prompt_mask": np.zeros(sum(LENGTHS), dtype=bool)})
        dist.barrier()

        def recomputed(phase: str) -> tuple[torch.Tensor, dict]:
            """actor_inf on its copy, as the master asks it of every rank."""
            path = f"{out}/{phase}.r{rank}.h5"
            reply = handlers.inference(
                {"mfc": "actor_inf", "refs": refs(data, range(len(LENGTHS))), "out": path}
            )
            return torch.from_numpy(read_batch(path)["proximal_logprobs"]), reply["stats"]

        before, first = recomputed("before")
        home = mfc_spec(cfg, "actor_train")
        part = np.array_split(np.arange(len(LENGTHS)), home.data)[home.coords(rank)[0]]
        rollout = f"{out}/rollout.h5"
        train = ppo_batch(before)
        if rank == 0:
            write_batch(rollout, train)
        dist.barrier()
        handlers.train_step({"mfc": "actor_train", "refs": refs(rollout, part, train.keys() - {CU})})
        after, second = recomputed("after")
        copies["d2p1m2"].load_weights(actor.hf_weights())
        actor.save_hf(f"{out}/snapshot")
        dist.barrier()  # rank 0 wrote it
        copies["d2p2m1"].load_hf(f"{out}/snapshot")
        result = {
            "trained": actor.logprobs(packed(), 1.0, SPEC),
            "before": before,
            "after": after,
            "stats": [first, second],
            **{name: copy.logprobs(packed(), 1.0, SPEC) for name, copy in copies.items()},
        }
        torch.save(result, f"{out}/result{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy()


@pytest.fixture(scope="module")
def ranks(tiny_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("realloc")
    toy = Toy(out, tiny_build.model_dir, tiny_build.root / "data" / "easy")
    cfg = toy.config(
        "realloc", 4, LAYOUTS, "cluster.n_nodes=1", "cluster.n_gpus_per_node=5", "actor.backend=megatron",
        "actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.optimizer.warmup_steps_proportion=0",
    )  # fmt: skip
    mp.spawn(_rank, args=(cfg, str(out)), nprocs=4)
    return [torch.load(out / f"result{r}.pt") for r in range(4)]


def test_the_copy_on_another_layout_takes_the_trained_weights_before_its_next_call(ranks):
    for rank in ranks:
        assert rank["stats"][0] == {}  # loaded from the same checkpoint: nothing to move
        assert rank["stats"][1]["timeperf/param_realloc"] > 0
        assert (rank["after"] - rank["before"]).abs().max() > 1e-3  # the step changed the weights
        torch.testing.assert_close(rank["after"], rank["trained"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", COPIES)
def test_copies_at_every_layout_give_the_trained_models_logprobs(ranks, layout):
    for rank in ranks:  # d2p1m2 took the weights over torch.distributed, d2p2m1 from an HF snapshot
        torch.testing.assert_close(rank[layout], rank["trained"], atol=1e-5, rtol=0)
