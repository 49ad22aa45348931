"""Ulysses sequence parallelism (allocation_mode's c) on gloo ranks: a context group of c ranks computes what one
rank does on packed micro-batches of uneven lengths (logprobs, loss, gradient norm, weights after a step),
with data parallelism beside it, with gradient checkpointing, and with KV heads that c does not divide; and a
run whose actor trains on a context group."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.config.schema import MicroBatchSpec
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.monitor.stats import read_stats
from areal_hpc.train import dist
from areal_hpc.train.backends.fsdp.engine import FSDPEngine
from areal_hpc.train.microbatch import micro_batches
from areal_hpc.train.ulysses import padded
from tests.test_fsdp_engine import alone, model_config, nll, packed, weights

# Two minibatch parts of uneven lengths, none a multiple of 4: every row gets a padding sequence.
PARTS = ([9, 5, 13, 7, 4, 11], [6, 17, 3, 10])


def _rank_main(rank: int, world: int, context: int, checkpointing: bool, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, Path(out) / "dist_init", backend="gloo", timeout_s=120)
    try:
        engine = FSDPEngine(model_config(model_dir, checkpointing), total_train_steps=10, context=context)
        batch = packed(PARTS[rank // context])  # the data of this rank's replica, the same on its c ranks
        logp = engine.logprobs(batch, 0.7, MicroBatchSpec(max_tokens_per_mb=16))
        step = engine.train_minibatch(micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=24)), nll)
        torch.save({"weights": weights(engine), "logp": logp, "step": step}, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy()


def _one_rank(model_dir, parts) -> dict:
    """The data of every replica on one rank, as one minibatch: the step a layout with c must equal."""
    engine = FSDPEngine(model_config(model_dir), total_train_steps=10)
    mbs = [
        mb for lengths in parts for mb in micro_batches(packed(lengths), MicroBatchSpec(max_tokens_per_mb=24))
    ]
    step = engine.train_minibatch(mbs, nll)
    return {"weights": weights(engine), "step": step}


@pytest.mark.parametrize(
    "world, context, checkpointing",
    [(2, 2, False), (4, 4, True), pytest.param(4, 2, False, marks=pytest.mark.slow)],
    ids=["c2", "c4-kv-repeated-checkpointing", "d2c2"],
)
def test_a_context_group_equals_one_rank(tiny_model_dir, tmp_path, world, context, checkpointing):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, context, checkpointing, str(tiny_model_dir), str(tmp_path))
    mp.spawn(_rank_main, args=args, nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    reference = _one_rank(tiny_model_dir, PARTS[: world // context])
    for rank, got in enumerate(ranks):
        # its replica's logprobs, as transformers gives them, and the loss its context group computes
        expected = alone(tiny_model_dir, packed(PARTS[rank // context]), 0.7)
        torch.testing.assert_close(got["logp"], expected, atol=1e-5, rtol=0)
        assert got["step"]["loss"] == ranks[rank - rank % context]["step"]["loss"]
        assert got["step"]["grad_norm"] == pytest.approx(reference["step"]["grad_norm"], rel=1e-5)
        for name, tensor in reference["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0)
    replicas = sum(ranks[r]["step"]["loss"] for r in range(0, world, context))
    assert replicas == pytest.approx(reference["step"]["loss"], rel=1e-5)


@pytest.mark.slow  # four more processes; the padding of every row is in make test's c4 case
def test_a_micro_batch_shorter_than_its_context_group(tiny_model_dir, tmp_path):
    """A row of 3 tokens on 4 ranks: three hold one token each and one only padding."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_short_main, args=(str(tiny_model_dir), str(tmp_path)), nprocs=4)
    expected = alone(tiny_model_dir, packed([3]), 1.0)
    for rank in range(4):
        torch.testing.assert_close(torch.load(tmp_path / f"short{rank}.pt"), expected, atol=1e-5, rtol=0)


def _short_main(rank: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, 4, Path(out) / "dist_init", backend="gloo", timeout_s=120)
    try:
        engine = FSDPEngine(model_config(model_dir), context=4)
        torch.save(engine.logprobs(packed([3]), 1.0, MicroBatchSpec()), Path(out) / f"short{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy()


def test_padding_makes_a_row_a_multiple_of_the_context_size():
    assert padded(torch.tensor([0, 4, 8]), 4).tolist() == [0, 4, 8]
    assert padded(torch.tensor([0, 4, 9]), 4).tolist() == [0, 4, 9, 12]
    assert np.array_equal(padded(torch.tensor([0, 3]), 2).numpy(), [0, 3, 4])


def test_grpo_steps_with_the_actor_on_a_context_group_of_two(toy):
    """The real processes: a server and a context group of two trainer ranks (d1c2). Its samples count once,
    the recomputed logprobs equal the server's (importance weight 1), and a checkpoint is written."""
    layout = ("allocation_mode=builtin.d1p1m1+d1p1m1c2", "cluster.n_nodes=1", "cluster.n_gpus_per_node=3")
    cfg = toy.config("c2", 2, *layout, "ppo.recompute_logprob=true", "ppo.use_decoupled_loss=true")
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    steps = [r for r in read_stats(run.stats) if "ppo_actor/task_reward/avg" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["ppo_actor/n_seqs"] == 4 * 2 for r in steps)  # one replica: counted once, not c times
    assert all(r["ppo_actor/importance_weight/avg"] == pytest.approx(1.0, abs=1e-3) for r in steps)
    assert (run.root / "checkpoints/actor/epoch0epochstep2globalstep2/model.safetensors").is_file()
