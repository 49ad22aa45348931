"""TorchEngine: micro-batched logprobs, packing, gradient accumulation, LR schedule, HF saves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_hpc.config.schema import MicroBatchSpec, OptimizerConfig, TrainedModelConfig
from areal_hpc.train.backends.torch.engine import TorchEngine
from areal_hpc.train.microbatch import micro_batch_groups, micro_batches, minibatches
from areal_hpc.train.models import ValueModel
from areal_hpc.train.numerics import lr_factor, token_logprobs
from areal_hpc.train.stats import StatsTracker

LENGTHS = [9, 5, 13, 7, 4, 11]


def model_config(path, **opt) -> TrainedModelConfig:
    optimizer = OptimizerConfig(**{"lr": 1e-3, "warmup_steps_proportion": 0.0, **opt})
    return TrainedModelConfig(
        path=str(path), dtype="float32", gradient_checkpointing=False, optimizer=optimizer
    )


def packed(lengths=LENGTHS, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    prompt_mask = np.concatenate([np.arange(n) < 2 for n in lengths])
    return {"cu_seqlens": cu, "packed_input_ids": rng.integers(3, 1000, cu[-1]), "prompt_mask": prompt_mask}


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TorchEngine:
    return TorchEngine(model_config(tiny_model_dir), total_train_steps=10, seed=1)


def reference_logprobs(model, batch, temperature) -> torch.Tensor:
    """Each sequence alone through a plain forward, no padding, no packing."""
    cu, ids = batch["cu_seqlens"], torch.from_numpy(batch["packed_input_ids"]).to(model.device)
    out = []
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            logits = model(input_ids=ids[a:b][None]).logits[0] / temperature
            lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[a + 1 : b, None]).squeeze(-1)
            out.append(torch.cat([torch.zeros(1, device=lp.device), lp]))
    return torch.cat(out).cpu()


@pytest.mark.parametrize(("max_tokens", "n_mbs"), [(10**6, 1), (16, 1), (1, 1), (10**6, 4)])
def test_logprobs_match_a_plain_forward(engine, max_tokens, n_mbs):
    batch = packed()
    expected = reference_logprobs(engine.model, batch, temperature=0.7)
    got = engine.logprobs(batch, 0.7, MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=max_tokens))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got[batch["cu_seqlens"][:-1]] == 0).all()


def test_token_logprobs_divides_by_temperature():
    logits = torch.tensor([[0.0, 2.0], [1.0, 0.0], [0.0, 0.0]])
    lp = token_logprobs(logits, torch.tensor([0, 1, 0]), torch.tensor([0, 3]), temperature=2.0)
    assert lp[0] == 0
    assert lp[1].item() == pytest.approx(1.0 - math.log(1 + math.e))
    assert lp[2].item() == pytest.approx(0.5 - math.log(1 + math.exp(0.5)))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("max_tokens", "n_mbs"), [(20, 1), (7, 1), (1000, 3), (12, 5)])
def test_micro_batches_respect_the_budget(seed, max_tokens, n_mbs):
    lengths = np.random.default_rng(seed).integers(1, 15, 9).tolist()
    groups = micro_batch_groups(lengths, MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=max_tokens))
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) >= n_mbs
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups)


def test_micro_batches_repack_every_array():
    batch = packed()
    mbs = micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=14))
    assert sum(len(mb["cu_seqlens"]) - 1 for mb in mbs) == len(LENGTHS)
    assert all(mb["cu_seqlens"][-1] <= 14 or len(mb["cu_seqlens"]) == 2 for mb in mbs)
    assert sum(len(mb["packed_input_ids"]) for mb in mbs) == sum(LENGTHS)


def test_minibatches_keep_every_rank_in_step():
    """A rank with fewer sequences than minibatches gets empty (None) parts, so it joins every step."""
    batch = packed(lengths=[5, 6])
    parts = minibatches(batch, 3)
    assert [p if p is None else p["cu_seqlens"].tolist() for p in parts] == [[0, 5], [0, 6], None]
    assert [len(p["cu_seqlens"]) - 1 for p in minibatches(packed(), 2)] == [3, 3]


def test_stats_tracker_weights_averages_by_counts():
    tracker = StatsTracker()
    tracker.masked("x", torch.tensor([1.0, 2.0, 9.0]), torch.tensor([True, True, False]))
    tracker.masked("x", torch.tensor([6.0]), torch.tensor([True]))
    tracker.masked("never", torch.tensor([1.0]), torch.tensor([False]))
    tracker.total("n", 3)
    tracker.total("n", torch.tensor(4))
    tracker.mean("lr", 1.0)
    tracker.mean("lr", 2.0)
    assert tracker.reduce("s") == {"s/x/avg": 3.0, "s/x/min": 1.0, "s/x/max": 6.0, "s/n": 7.0, "s/lr": 1.5}


def nll_loss_fn(normaliser):
    def loss_fn(out, mb):
        logp = out["logprobs"]
        return -torch.where(mb["prompt_mask"], 0.0, logp).sum() / normaliser

    return loss_fn


def test_gradient_does_not_depend_on_the_micro_batching(engine):
    """Each micro-batch loss divided by the minibatch's token count: the accumulated gradient is the same."""
    batch = packed()
    normaliser = float((~batch["prompt_mask"]).sum())
    grads = []
    for max_tokens in (10**6, 10, 1):
        engine.optimizer.zero_grad(set_to_none=True)
        engine.backward(
            micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=max_tokens)), nll_loss_fn(normaliser)
        )
        grads.append(torch.cat([p.grad.reshape(-1) for p in engine.model.parameters()]))
    engine.optimizer.zero_grad(set_to_none=True)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "steps", "expected"),
    [
        ("constant", [0, 4, 9, 10, 50, 200], [0.1, 0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0, 9, 10, 55, 100, 150], [0.1, 1.0, 1.0, 0.55, 0.1, 0.1]),
        ("cosine", [10, 32, 55, 100], [1.0, 0.1 + 0.45 * (1 + math.cos(math.pi * 22 / 90)), 0.55, 0.1]),
    ],
)
def test_lr_schedule(schedule, steps, expected):
    opt = OptimizerConfig(lr_scheduler_type=schedule, warmup_steps_proportion=0.1, min_lr_ratio=0.1)
    assert [lr_factor(s, 100, opt) for s in steps] == pytest.approx(expected)


def test_engine_steps_follow_the_schedule(tiny_model_dir):
    cfg = model_config(
        tiny_model_dir, lr_scheduler_type="linear", warmup_steps_proportion=0.2, min_lr_ratio=0.0
    )
    engine = TorchEngine(cfg, total_train_steps=10, seed=1)
    lrs = [engine.train_minibatch([], nll_loss_fn(1.0))["lr"] for _ in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * 7 / 8])


def test_save_hf_round_trips(engine, tmp_path, tiny_model_dir):
    engine.train_minibatch(micro_batches(packed(), MicroBatchSpec()), nll_loss_fn(10.0))
    out = engine.save_hf(tmp_path / "ckpt")
    engine.save_hf(tmp_path / "ckpt")  # saving again replaces the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = {k: v.cpu() for k, v in engine.model.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], atol=0, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not torch.equal(original.model.embed_tokens.weight, loaded.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_save_hf_in_bfloat16(tiny_model_dir, tmp_path):
    cfg = TrainedModelConfig(path=str(tiny_model_dir), dtype="bfloat16", gradient_checkpointing=True)
    engine = TorchEngine(cfg, total_train_steps=1, seed=1)
    assert next(engine.model.parameters()).dtype == torch.float32  # master weights; autocast in forward
    engine.train_minibatch(micro_batches(packed(), MicroBatchSpec()), nll_loss_fn(10.0))
    loaded = AutoModelForCausalLM.from_pretrained(engine.save_hf(tmp_path / "bf16"))
    assert loaded.dtype == torch.bfloat16
    torch.testing.assert_close(
        loaded.model.norm.weight, engine.model.model.norm.weight.cpu().to(torch.bfloat16), atol=0, rtol=0
    )


def test_critic_engine_values_and_save(tiny_model_dir, tmp_path):
    critic = TorchEngine(model_config(tiny_model_dir), total_train_steps=1, seed=1, critic=True)
    batch = packed()
    assert torch.equal(critic.values(batch, MicroBatchSpec()), torch.zeros(sum(LENGTHS)))  # zero head
    torch.nn.init.normal_(critic.model.value_head.weight)
    values = critic.values(batch, MicroBatchSpec(max_tokens_per_mb=8))
    reloaded = ValueModel.from_pretrained(critic.save_hf(tmp_path / "critic"), torch.float32)
    ids = torch.from_numpy(batch["packed_input_ids"][: LENGTHS[0]])[None]
    with torch.no_grad():
        again = reloaded(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
    torch.testing.assert_close(again, values[: LENGTHS[0]], atol=1e-5, rtol=0)


def test_inference_only_engine_cannot_train(tiny_model_dir):
    ref = TorchEngine(model_config(tiny_model_dir), total_train_steps=None)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="inference-only"):
        ref.train_minibatch([], nll_loss_fn(1.0))
