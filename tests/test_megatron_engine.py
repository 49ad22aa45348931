"""The megatron backend on CPU gloo ranks: HF <-> Megatron conversion bit for bit, the GPTModel's logprobs
equal to the HF model's at TP=1, TP=2 and PP=2, and a training step at TP=2 and PP=2 equal to TP=1's."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal_hpc.algo.aggregation import Totals, aggregate
from areal_hpc.config import allocation_of, megatron_model_problems
from areal_hpc.config.schema import MicroBatchSpec
from areal_hpc.data import CU
from areal_hpc.train import TrainerHandlers, dist
from areal_hpc.train.backends.megatron import convert
from areal_hpc.train.microbatch import micro_batches
from tests.test_fsdp_engine import LENGTHS, alone, mlp_starts, model_config, nll, packed

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tensor, pipeline)


def seq_mean_nll(out, mb):
    """Each sequence's mean NLL, averaged over the batch's sequences (loss_agg_mode seq-mean-token-mean): the
    micro-batches of the last pipeline stage weigh their tokens by their own sequences and the batch's totals."""
    mask = torch.ones_like(out["logprobs"], dtype=torch.bool)
    return aggregate(
        -out["logprobs"], mask, mb[CU], "seq-mean-token-mean", Totals(sum(LENGTHS), len(LENGTHS))
    )


def hf_of(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_and_back_is_bit_exact(tiny_model_dir, tp, pp):
    hf, weights = hf_of(tiny_model_dir), load_file(tiny_model_dir / "model.safetensors")
    back = {}
    for pp_rank in range(pp):
        layouts = [convert.Layout(tp, r, pp, pp_rank) for r in range(tp)]
        ranks = [
            dict((n, t) for n, _, t in convert.load_shards(hf, lay, weights.__getitem__)) for lay in layouts
        ]
        for name, param in convert.exported(hf, layouts[0]).items():
            full = convert.unshard(param, [r[name] for r in ranks], hf)
            back.update(zip(param.hf_names, full, strict=True))
    assert back.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_keeps_each_kv_group_whole_on_a_tp_rank():
    q, k, v = torch.arange(8)[:, None] * 1.0, torch.arange(100, 104)[:, None] * 1.0, -torch.arange(4)[:, None]
    fused = convert.fuse_qkv(q, k, v, groups=2)  # 4 query rows and 2 of k and v per group
    assert fused[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 0, -1, 4, 5, 6, 7, 102, 103, -2, -3]
    assert all(torch.equal(a, b) for a, b in zip(convert.split_qkv(fused, 2, 4), (q, k, v), strict=True))


def test_models_the_backend_cannot_build_are_named():
    hf = {
        "model_type": "qwen2",
        "num_hidden_layers": 3,
        "vocab_size": 1001,
        "rope_parameters": {"rope_type": "yarn"},
    }
    problems = megatron_model_problems(hf, tp=2, pp=2)
    assert any("rope_type 'yarn'" in p for p in problems)
    assert any("3 layers do not split evenly into 2 pipeline stages" in p for p in problems)
    assert any("(1001) does not split evenly over tensor size 2" in p for p in problems)
    assert "gemma" in megatron_model_problems({"model_type": "gemma"})[0]


def _rank_main(rank, world, tp, pp, model_dir, out):
    torch.set_num_threads(1)
    dist.init_distributed(rank, world, f"{out}.init", backend="gloo", timeout_s=300)
    try:
        from areal_hpc.train.backends.megatron.engine import MegatronEngine

        engine = MegatronEngine(model_config(model_dir), total_train_steps=10, tensor=tp, pipeline=pp)
        batch = packed()
        before = engine.logprobs(batch, 1.0, MicroBatchSpec(max_tokens_per_mb=16))
        for _ in engine.hf_weights():  # a publication before the step: the one after must see the step
            pass
        mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=20))
        skipped = engine.train_minibatch(mbs, seq_mean_nll, skip=lambda: True)  # as an early stop asks
        skipped["logprobs"] = engine.logprobs(batch, 1.0, MicroBatchSpec(max_tokens_per_mb=16))
        step = engine.train_minibatch(
            micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=20)), seq_mean_nll
        )
        after = engine.logprobs(batch, 0.7, MicroBatchSpec(max_tokens_per_mb=16))
        weights = dict(engine.hf_weights())
        saved = engine.save_hf(f"{out}.saved")  # rank 0 returns the directory
        result = {"before": before, "skipped": skipped, "step": step, "after": after, "weights": weights}
        result["saved"] = saved
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Each layout of LAYOUTS run once on tp * pp gloo ranks: rank 0's results."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = {}
    for tp, pp in LAYOUTS:
        prefix = str(tmp_path_factory.mktemp(f"tp{tp}pp{pp}") / "rank")
        mp.spawn(_rank_main, args=(tp * pp, tp, pp, str(tiny_model_dir), prefix), nprocs=tp * pp)
        out[tp, pp] = [torch.load(f"{prefix}.{r}") for r in range(tp * pp)]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_logprobs_equal_the_hf_models(runs, tiny_model_dir, layout):
    expected = alone(tiny_model_dir, packed(), 1.0)
    for rank in runs[layout]:  # every rank answers, the pipeline's first stage too
        torch.testing.assert_close(rank["before"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_skipped_step_leaves_the_weights_as_they_were(runs, layout):
    for rank in runs[layout]:
        assert torch.equal(rank["skipped"]["logprobs"], rank["before"]) and math.isnan(
            rank["skipped"]["grad_norm"]
        )


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)])
def test_a_training_step_equals_one_ranks(runs, layout):
    one, many = runs[1, 1][0], runs[layout]
    for rank in many:
        assert rank["step"]["loss"] == pytest.approx(one["step"]["loss"], rel=1e-6)
        assert rank["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-5)
        torch.testing.assert_close(rank["after"], one["after"], atol=1e-5, rtol=0)
    for name, tensor in many[0]["weights"].items():
        torch.testing.assert_close(tensor, one["weights"][name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_gets_the_whole_model_and_save_hf_writes_it_for_transformers(runs, layout):
    ranks = runs[layout]
    saved = AutoModelForCausalLM.from_pretrained(ranks[0]["saved"], dtype=torch.float32).state_dict()
    assert ranks[0]["weights"].keys() == runs[1, 1][0]["weights"].keys()
    for name, tensor in ranks[0]["weights"].items():
        torch.testing.assert_close(saved[name], tensor, atol=0, rtol=0)
        for rank in ranks[1:]:  # the other TP rank, or the other pipeline stage
            torch.testing.assert_close(rank["weights"][name], tensor, atol=0, rtol=0)


def _recover_rank(rank: int, layout: str, phase: str, cfg, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, 2, f"{out}/init-{phase}", backend="gloo", timeout_s=120)
    handlers = TrainerHandlers(cfg, rank, 2)
    try:
        handlers.initialize({"total_train_steps": 4})
        actor = handlers.engines["actor"]
        spec = allocation_of(cfg).train_spec("actor_train")
        part = np.array_split(np.arange(len(LENGTHS)), spec.data)[spec.coords(rank)[0]]
        batch = packed([LENGTHS[i] for i in part])  # this rank's data-parallel replica's sequences

        def step():
            actor.train_minibatch(micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=16)), nll)

        if phase == "save":
            step()
            handlers.recover_save({"dir": folder})
            handlers.recover_wait(None)
        else:
            handlers.recover_load({"dir": folder})
        weights = {name: t.clone() for name, t in actor.hf_weights()}
        step()  # the same only if Adam's state and the master weights came back
        after = {name: t.clone() for name, t in actor.hf_weights()}
        torch.save({"weights": weights, "after": after}, f"{out}/{phase}{rank}.pt")
        dist.barrier()
    finally:
        handlers.saver.close() if handlers.saver else None
        dist.destroy()


@pytest.mark.parametrize("layout", ["d1p1m2", "d2p1m1", "d2p1m1e2"])
def test_a_recover_checkpoint_resumes_the_same_layout_bit_for_bit(toy, tmp_path, layout, request):
    moe = [f"actor.path={request.getfixturevalue('tiny_moe_dir')}"] if "e" in layout else []  # experts split
    cfg = toy.config(
        "megatron-recover", 4, "actor.backend=megatron", f"allocation_mode=builtin.d1p1m1+{layout}",
        "cluster.n_nodes=1", "cluster.n_gpus_per_node=3", "actor.dtype=float32",
        "actor.optimizer.warmup_steps_proportion=0", *moe,
    )  # fmt: skip
    folder = tmp_path / "ckpt"
    for phase in ("save", "load"):
        mp.spawn(_recover_rank, args=(layout, phase, cfg, str(folder), str(tmp_path)), nprocs=2)
    files = list((folder / "shards").iterdir())
    assert len(files) == 2  # a file of each rank
    n_weights = sum(t.numel() for t in torch.load(tmp_path / "save0.pt")["weights"].values())
    assert sum(f.stat().st_size for f in files) < 1.1 * n_weights * 4 * 3  # weights, Adam's moments: once
    for rank in range(2):
        saved, loaded = (torch.load(tmp_path / f"{phase}{rank}.pt") for phase in ("save", "load"))
        for name, tensor in saved["weights"].items():
            assert torch.equal(loaded["weights"][name], tensor), name
            assert torch.equal(loaded["after"][name], saved["after"][name]), name


def _checkpointing_rank(rank, model_dir, out):
    dist.init_distributed(0, 1, f"{out}.init", backend="gloo", timeout_s=120)
    try:
        from areal_hpc.train.backends.megatron.engine import MegatronEngine

        results = []
        for recompute, layers in ((False, None), (True, None), (True, 1)):
            engine = MegatronEngine(model_config(model_dir, recompute, recompute_layers=layers), 10)
            calls = mlp_starts(engine.model.decoder.layers)  # twice in a step where a layer is recomputed
            step = engine.train_minibatch(micro_batches(packed(), MicroBatchSpec(max_tokens_per_mb=20)), nll)
            ran = list(calls)
            results.append((step, engine.logprobs(packed(), 1.0, MicroBatchSpec()), ran))
        torch.save(results, out)
    finally:
        dist.destroy()


def test_gradient_checkpointing_changes_no_result(tiny_model_dir, tmp_path):
    mp.spawn(_checkpointing_rank, args=(str(tiny_model_dir), str(tmp_path / "out")), nprocs=1)
    (plain, plain_logp, ran), *recomputed = torch.load(tmp_path / "out")
    m = ran[0]  # micro-batches: each layer's MLP starts once in each without recomputation
    assert m > 1  # the recompute's counts hold across several micro-batches, not only one
    assert [ran] + [r for *_, r in recomputed] == [[m, m], [2 * m, 2 * m], [2 * m, m]]  # recompute_layers 1
    for step, logp, _ in recomputed:
        assert step == plain
        assert torch.equal(logp, plain_logp)


def _released_rank(rank, model_dir, out):
    dist.init_distributed(0, 1, f"{out}.init", backend="gloo", timeout_s=120)
    try:
        from areal_hpc.train.backends.megatron.engine import MegatronEngine

        results = []
        for release in (False, True):
            engine = MegatronEngine(model_config(model_dir), 10)
            steps, held = [], []
            for _ in range(2):
                steps.append(
                    engine.train_minibatch(micro_batches(packed(), MicroBatchSpec(max_tokens_per_mb=20)), nll)
                )
                if release:
                    engine.release_memory()
                held.append(sum(b.grad_data.untyped_storage().nbytes() for b in engine.ddp.buffers))
            results.append((steps, held, engine.logprobs(packed(), 1.0, MicroBatchSpec())))
        torch.save(results, out)
    finally:
        dist.destroy()


def test_gradient_buffers_given_back_between_steps_change_no_result(tiny_model_dir, tmp_path):
    """A colocated trainer frees its gradient buffers while the servers generate (release_memory): the next
    step takes them back, zeroed, and trains as if they had stayed."""
    mp.spawn(_released_rank, args=(str(tiny_model_dir), str(tmp_path / "out")), nprocs=1)
    (kept, kept_bytes, kept_logp), (released, released_bytes, released_logp) = torch.load(tmp_path / "out")
    assert min(kept_bytes) > 0 and released_bytes == [0, 0]
    assert released == kept
    assert torch.equal(released_logp, kept_logp)
