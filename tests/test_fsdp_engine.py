"""FSDPEngine: packed micro-batches equal each sequence alone, no [tokens, vocab] logits, sharded steps that
equal one rank's, uneven micro-batch counts, optimizer offload, HF saves assembled from shards."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from areal_hpc.config.schema import MicroBatchSpec, OptimizerConfig, TrainedModelConfig
from areal_hpc.train import dist
from areal_hpc.train.backends.fsdp.engine import FSDPEngine
from areal_hpc.train.microbatch import micro_batches
from areal_hpc.train.models import ValueModel
from tests.helpers import OutputProbe

LENGTHS = [9, 5, 13, 7, 4, 11]


def model_config(
    path, gradient_checkpointing=False, offload=False, recompute_layers=None
) -> TrainedModelConfig:
    opt = OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0, offload=offload)
    return TrainedModelConfig(
        path=str(path), dtype="float32", gradient_checkpointing=gradient_checkpointing,
        recompute_layers=recompute_layers, optimizer=opt,
    )  # fmt: skip


def packed(lengths=LENGTHS, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {"cu_seqlens": cu, "packed_input_ids": rng.integers(3, 1000, cu[-1])}


def nll(out, mb):  # a loss from the token logprobs, as the PPO and SFT losses are
    return -out["logprobs"].sum() / 50


def alone(model_dir, batch, temperature) -> torch.Tensor:
    """Each sequence through the HF model by itself: no packing, no padding, transformers' own attention."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cu, ids = batch["cu_seqlens"], torch.from_numpy(batch["packed_input_ids"])
    out = []
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            logp = torch.log_softmax(model(input_ids=ids[a:b][None]).logits[0] / temperature, -1)
            out += [torch.zeros(1), logp[:-1].gather(-1, ids[a + 1 : b, None]).squeeze(-1)]
    return torch.cat(out)


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.hf_weights()}


@pytest.mark.parametrize("max_tokens", [10**6, 16, 1])
def test_a_packed_micro_batch_gives_each_sequences_logprobs_alone(tiny_model_dir, max_tokens):
    batch = packed()
    engine = FSDPEngine(model_config(tiny_model_dir))
    got = engine.logprobs(batch, 0.7, MicroBatchSpec(max_tokens_per_mb=max_tokens))
    torch.testing.assert_close(got, alone(tiny_model_dir, batch, 0.7), atol=1e-5, rtol=0)


def test_no_op_holds_the_logits_of_the_whole_micro_batch(tiny_model_dir):
    """Forward and backward of a 512-token micro-batch with a 64-token head chunk: no tensor comes near
    tokens x vocab elements (the tiny vocabulary is 1024). The largest, just above a chunk of logits, is the
    all-gathered embedding (65,600 elements with the final norm)."""
    engine = FSDPEngine(model_config(tiny_model_dir), total_train_steps=10)
    engine.net.chunk_tokens = 64
    batch = packed([128] * 4)
    mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=10**6))
    with OutputProbe() as probe:
        engine.logprobs(batch, 1.0, MicroBatchSpec(max_tokens_per_mb=10**6))
        engine.train_minibatch(mbs, nll)
    assert probe.largest <= 2 * 64 * 1024 < 512 * 1024


def test_gradient_checkpointing_and_offload_change_no_result(tiny_model_dir):
    batch = packed()
    mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=16))
    results = []
    for kw in ({}, {"gradient_checkpointing": True}, {"gradient_checkpointing": True, "recompute_layers": 1},
               {"offload": True}):  # fmt: skip
        engine = FSDPEngine(model_config(tiny_model_dir, **kw), total_train_steps=10)
        steps = [engine.train_minibatch(mbs, nll) for _ in range(2)]
        results.append((steps, weights(engine)))
    (plain_steps, plain), *others = results
    for steps, got in others:
        assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in plain_steps], abs=1e-6)
        for name, tensor in plain.items():
            torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0)


def mlp_starts(layers) -> list[int]:
    """How many times each layer's MLP starts from now on (a list that forward hooks count into)."""
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("layers, runs", [(None, [2, 2]), (1, [2, 1]), (0, [1, 1])])
def test_recompute_layers_recomputes_the_first_layers_only(tiny_model_dir, layers, runs):
    """Each decoder layer's MLP starts twice in a step when its layer is recomputed, once when it keeps its
    activations. (A forward hook would miss the recompute: it stops once the tensors backward needs are back.)"""
    engine = FSDPEngine(model_config(tiny_model_dir, True, recompute_layers=layers), total_train_steps=10)
    calls = mlp_starts(engine.net.model.model.layers)
    engine.train_minibatch(micro_batches(packed(), MicroBatchSpec(max_tokens_per_mb=10**6)), nll)
    assert calls == runs


def test_recompute_layers_beyond_the_model_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="recompute_layers 3: the model has 2 decoder layers"):
        FSDPEngine(model_config(tiny_model_dir, True, recompute_layers=3), total_train_steps=10)


def moments(engine) -> list[torch.Tensor]:
    return [t for state in engine.optimizer.state.values() for k, t in state.items() if k != "step"]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def leaves(state: dict):
    for value in state.values():
        yield from leaves(value) if isinstance(value, dict) else [value]


def test_offloaded_adam_state_is_made_before_the_first_step_and_loaded_in_place(tiny_model_dir):
    """optimizer.offload: the state exists from the start (a fresh engine's checkpoint holds AdamW's state
    before any step, where torch would make it with a step on the device), and a recover load fills those same
    CPU tensors: from another engine's state, or read into the engine's own (the trainer's load). The next
    step is the uninterrupted one's."""
    mbs = micro_batches(packed(), MicroBatchSpec(max_tokens_per_mb=16))
    engines = [FSDPEngine(model_config(tiny_model_dir, offload=True), total_train_steps=10) for _ in range(3)]
    trained, copied, read = engines
    for _ in range(2):
        trained.train_minibatch(mbs, nll)
    saved, before = trained.state_dict(), {e: moments(e) for e in engines[1:]}
    own = read.state_dict()
    assert {s["step"].item() for s in own["optimizer"].values()} == {0.0}
    assert not any(t.count_nonzero() for t in moments(read))
    for dst, src in zip(leaves(own), leaves(saved), strict=True):  # as DCP reads: into the tensors given
        local(dst).copy_(local(src))
    copied.load_state_dict(saved)
    read.load_state_dict(own)
    for engine in engines:
        assert engine is trained or all(a is b for a, b in zip(moments(engine), before[engine], strict=True))
        engine.train_minibatch(mbs, nll)
    for engine in engines[1:]:
        for name, tensor in weights(trained).items():
            torch.testing.assert_close(weights(engine)[name], tensor, atol=1e-6, rtol=0)


def test_saves_an_hf_directory_and_a_critic_with_its_head(tiny_model_dir, tmp_path):
    actor = FSDPEngine(model_config(tiny_model_dir), total_train_steps=10)
    loaded = AutoModelForCausalLM.from_pretrained(actor.save_hf(tmp_path / "actor"), dtype=torch.float32)
    expected = weights(actor)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected.get(name, expected["model.embed_tokens.weight"]))
    critic = FSDPEngine(model_config(tiny_model_dir), total_train_steps=10, critic=True)
    batch = packed()
    target = lambda out, mb: ((out["values"] - 1.0) ** 2).sum()  # noqa: E731
    critic.train_minibatch(micro_batches(batch, MicroBatchSpec()), target)
    reloaded = ValueModel.from_pretrained(critic.save_hf(tmp_path / "critic"), torch.float32)
    assert reloaded.value_head.bias.item() == pytest.approx(weights(critic)["value_head.bias"].item())


# --- two gloo ranks -----------------------------------------------------------------------------------------


def _rank_main(rank: int, model_dir: str, out_dir: str) -> None:
    """Rank 0 trains on three micro-batches, rank 1 on none (a rank with no sequences in a minibatch)."""
    torch.set_num_threads(1)
    dist.init_distributed(rank, 2, Path(out_dir) / "dist_init", backend="gloo", timeout_s=120)
    try:
        engine = FSDPEngine(model_config(model_dir), total_train_steps=10)
        batch = packed()
        mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=20)) if rank == 0 else []
        logp = engine.logprobs(batch if rank == 0 else packed([3]), 1.0, MicroBatchSpec(max_tokens_per_mb=8))
        step = engine.train_minibatch(mbs, nll)
        path = engine.save_hf(Path(out_dir) / "saved")
        torch.save({"weights": weights(engine), "logp": logp, "step": step}, Path(out_dir) / f"rank{rank}.pt")
        assert (path is None) == (rank != 0)
        dist.barrier()  # no rank leaves while another's last collective is in flight
    finally:
        dist.destroy()


def test_two_ranks_with_uneven_micro_batches_equal_one_rank(tiny_model_dir, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(str(tiny_model_dir), str(tmp_path)), nprocs=2)
    single = FSDPEngine(model_config(tiny_model_dir), total_train_steps=10)
    batch = packed()
    logp = single.logprobs(batch, 1.0, MicroBatchSpec(max_tokens_per_mb=8))
    step = single.train_minibatch(micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=20)), nll)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(ranks[0]["logp"], logp, atol=1e-6, rtol=0)
    assert ranks[0]["step"]["grad_norm"] == ranks[1]["step"]["grad_norm"]
    assert ranks[0]["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).state_dict()
    for name, tensor in weights(single).items():
        torch.testing.assert_close(ranks[1]["weights"][name], ranks[0]["weights"][name], atol=0, rtol=0)
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, atol=1e-6, rtol=0)
        torch.testing.assert_close(saved[name], ranks[0]["weights"][name], atol=0, rtol=0)
