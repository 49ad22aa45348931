"""The model function calls on a rank: PPO actor, critic and SFT train steps, inference, and two gloo ranks."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from areal_hpc.config.schema import (
    BehavCorrectionConfig,
    MicroBatchSpec,
    OptimizerConfig,
    PPOConfig,
    TrainedModelConfig,
)
from areal_hpc.data.batch import read_batch, write_batch
from areal_hpc.train import dist
from areal_hpc.train.backends import TrainEngine, make_engine
from areal_hpc.train.interfaces import (
    actor_inference,
    actor_train_step,
    critic_inference,
    critic_train_step,
    ref_inference,
    sft_train_step,
)

MB = MicroBatchSpec(max_tokens_per_mb=24)
PPO = PPOConfig(ppo_n_minibatches=1, kl_ctl=0.0, group_adv_norm=False)
RANK_SEQS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # the data-parallel parts of the two-rank test


def model_config(path, lr=1e-3, backend="fsdp") -> TrainedModelConfig:
    opt = OptimizerConfig(lr=lr, warmup_steps_proportion=0.0)
    return TrainedModelConfig(
        path=str(path), backend=backend, dtype="float32", gradient_checkpointing=False, optimizer=opt
    )


@pytest.fixture(params=["fsdp", "torch"])
def backend(request) -> str:
    return request.param


def rollout_batch(n_seqs: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """What a rollout writes: random prompts and answers, +-5 rewards, groups of four answers."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(7, 16, n_seqs)
    prompt_lens = rng.integers(2, 5, n_seqs)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {
        "cu_seqlens": cu,
        "packed_input_ids": rng.integers(3, 1000, cu[-1]),
        "prompt_mask": np.concatenate([np.arange(n) < p for n, p in zip(lengths, prompt_lens, strict=True)]),
        "rewards": rng.choice([-5.0, 5.0], n_seqs).astype(np.float32),
        "seq_no_eos_mask": rng.random(n_seqs) < 0.25,
        "group_ids": np.arange(n_seqs) // 4,
        "version_start": np.zeros(n_seqs, dtype=np.int64),
        "version_end": np.ones(n_seqs, dtype=np.int64),
    }


def with_logprobs(engine: TrainEngine, batch: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Add behaviour logprobs (the current policy's, slightly perturbed: stale samples) and proximal ones."""
    proximal = actor_inference(engine, batch, MB, PPO.gen.temperature)["proximal_logprobs"]
    noise = np.random.default_rng(seed).normal(0, 0.1, proximal.shape).astype(np.float32)
    behaviour = np.where(batch["prompt_mask"], 0.0, proximal + noise).astype(np.float32)
    return {**batch, "proximal_logprobs": proximal, "packed_logprobs": behaviour}


@pytest.fixture(scope="module")
def batch(tiny_model_dir) -> dict[str, np.ndarray]:
    return with_logprobs(make_engine(model_config(tiny_model_dir, backend="torch")), rollout_batch())


def weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in engine.hf_weights()}


def test_inference_outputs(tiny_model_dir, batch, backend):
    engine = make_engine(model_config(tiny_model_dir, backend=backend))
    ref = ref_inference(engine, batch, MB, 1.0)["packed_ref_logprobs"]
    assert ref.dtype == np.float32 and ref.shape == batch["packed_input_ids"].shape
    np.testing.assert_allclose(ref, batch["proximal_logprobs"], atol=1e-6)
    assert (ref[batch["cu_seqlens"][:-1]] == 0).all() and (ref[~batch["prompt_mask"]] < 0).all()


def test_ppo_step_changes_weights_and_lowers_the_loss(tiny_model_dir, batch, backend):
    engine = make_engine(model_config(tiny_model_dir, backend=backend), total_train_steps=10)
    before = weights(engine)
    first = actor_train_step(engine, batch, PPO, MB, global_step=3)
    after = weights(engine)
    assert any(not torch.equal(v, after[k]) for k, v in before.items())
    second = actor_train_step(engine, batch, PPO, MB, global_step=3)  # its loss is taken before updating
    assert second["ppo_actor/actor_loss/avg"] < first["ppo_actor/actor_loss/avg"] - 1e-3

    for name in ("task_reward", "seq_len", "prompt_len", "no_eos_ratios", "importance_weight", "clip_ratio",
                 "actor_loss", "approx_kl", "behave_imp_weight", "advantages", "head_offpolicyness"):  # fmt: skip
        assert {f"ppo_actor/{name}/{s}" for s in ("avg", "min", "max")} <= set(first), name
    assert first["ppo_actor/n_seqs"] == 8 and first["ppo_actor/n_tokens"] == batch["cu_seqlens"][-1]
    assert first["ppo_actor/n_valid_tokens"] == (~batch["prompt_mask"]).sum()  # answer tokens
    assert first["ppo_actor/lr"] == pytest.approx(1e-3) and first["ppo_actor/grad_norm"] > 0
    assert first["ppo_actor/task_reward/avg"] == pytest.approx(batch["rewards"].mean())
    assert first["ppo_actor/importance_weight/avg"] == pytest.approx(1.0, abs=1e-5)  # proximal = current
    assert first["ppo_actor/head_offpolicyness/avg"] == 3 and first["ppo_actor/tail_offpolicyness/avg"] == 2


def test_ppo_variants_run(tiny_model_dir, batch, backend):
    """GRPO normalisation, KL penalty, the plain (not decoupled) objective, several minibatches."""
    engine = make_engine(model_config(tiny_model_dir, backend=backend), total_train_steps=10)
    ppo = replace(PPO, group_adv_norm=True, kl_ctl=0.1, use_decoupled_loss=False, ppo_n_minibatches=3)
    stats = actor_train_step(engine, {**batch, "packed_ref_logprobs": batch["proximal_logprobs"]}, ppo, MB)
    assert "ppo_actor/behave_imp_weight/avg" not in stats and stats["ppo_actor/n_seqs"] == 8
    without_groups = {k: v for k, v in batch.items() if k != "group_ids"}
    with pytest.raises(KeyError, match="group_ids"):
        actor_train_step(engine, without_groups, replace(PPO, group_adv_norm=True), MB)


def test_the_algorithm_options_reach_the_loss(tiny_model_dir, batch):
    """GSPO's token variant, a clamping sequence-level correction, the KL (k3) in the loss, a leave-one-out
    baseline, the overlong penalty and filtering, distillation added to the task advantage."""
    engine = make_engine(model_config(tiny_model_dir), total_train_steps=10)
    ppo = replace(
        PPO, policy_loss="gspo_token", loss_agg_mode="seq-mean-token-sum-norm", kl_ctl=0.01, kl_in="loss",
        kl_estimator="k3", group_baseline="leave_one_out", adv_norm=False, overlong_buffer=0.5,
        overlong_filter=True, distill_coef=0.5,
        behav_correction=BehavCorrectionConfig(level="sequence", action="clamp", lower=0.9, upper=1.1),
    )  # fmt: skip
    data = {**batch, "packed_ref_logprobs": batch["proximal_logprobs"] - 0.1}
    data["packed_teacher_logprobs"] = batch["proximal_logprobs"] + 0.2
    stats = actor_train_step(engine, data, ppo, MB)
    assert stats["ppo_actor/kl_loss/avg"] > 0 and "ppo_actor/behave_clamped_ratio/avg" in stats
    assert stats["ppo_actor/teacher_kl/avg"] == pytest.approx(
        -0.2, abs=0.05
    )  # behaviour: proximal + N(0, 0.1)
    # Overlong filtering: the truncated answers' tokens leave the loss.
    truncated = np.repeat(batch["seq_no_eos_mask"], np.diff(batch["cu_seqlens"]))
    assert truncated.any() and stats["ppo_actor/n_valid_tokens"] == (~batch["prompt_mask"] & ~truncated).sum()
    with pytest.raises(KeyError, match="packed_teacher_logprobs"):
        actor_train_step(engine, batch, replace(ppo, kl_ctl=0.0), MB)


def test_early_stop_leaves_the_weights_as_they_were(tiny_model_dir, batch, backend):
    """Answers sampled by a policy e^3 times less likely to give them than the current one: the minibatch's
    mean ratio pi/mu (two policies) is far above ppo.early_stop_imp_ratio, so its step is skipped whole."""
    engine = make_engine(model_config(tiny_model_dir, backend=backend), total_train_steps=10)
    stale = np.where(batch["prompt_mask"], 0.0, batch["proximal_logprobs"] - 3.0).astype(np.float32)
    ppo = replace(PPO, use_decoupled_loss=False, recompute_logprob=False, early_stop_imp_ratio=5.0)
    before = weights(engine)
    stats = actor_train_step(engine, {**batch, "packed_logprobs": stale}, ppo, MB)
    assert stats["ppo_actor/early_stopped"] == 1.0 and stats["ppo_actor/importance_weight/avg"] > 5.0
    assert all(torch.equal(v, weights(engine)[k]) for k, v in before.items())
    stats = actor_train_step(engine, batch, replace(ppo, early_stop_imp_ratio=50.0), MB)
    assert stats["ppo_actor/early_stopped"] == 0.0
    assert any(not torch.equal(v, weights(engine)[k]) for k, v in before.items())


def test_the_loglinear_proximal_policy_needs_no_recomputed_logprobs(tiny_model_dir, batch):
    engine = make_engine(model_config(tiny_model_dir), total_train_steps=10)
    without = {k: v for k, v in batch.items() if k != "proximal_logprobs"}
    ppo = replace(PPO, prox_logp_method="loglinear", recompute_logprob=False)
    stats = actor_train_step(engine, without, ppo, MB, global_step=3)  # answers of version 0: stale
    assert stats["ppo_actor/head_offpolicyness/avg"] == 3 and stats["ppo_actor/behave_imp_weight/avg"] != 1.0
    with pytest.raises(ValueError, match="needs the train step's global_step"):
        actor_train_step(engine, without, ppo, MB)


def test_sft_step_lowers_the_nll(tiny_model_dir, batch, backend):
    engine = make_engine(model_config(tiny_model_dir, backend=backend), total_train_steps=10)
    sft = {k: batch[k] for k in ("cu_seqlens", "packed_input_ids", "prompt_mask")}
    first = sft_train_step(engine, sft, MB)
    second = sft_train_step(engine, sft, MB)
    assert second["sft/loss"] < first["sft/loss"] - 1e-2
    assert first["sft/ppl"] == pytest.approx(np.exp(first["sft/loss"]))
    assert first["sft/n_tokens"] == (~batch["prompt_mask"]).sum()


def test_critic_step_lowers_the_value_loss(tiny_model_dir, batch, backend):
    critic = make_engine(
        model_config(tiny_model_dir, lr=1e-2, backend=backend), total_train_steps=10, critic=True
    )
    data = {**batch, **critic_inference(critic, batch, MB)}
    ppo = replace(PPO, disable_value=False)
    first = critic_train_step(critic, data, ppo, MB)
    second = critic_train_step(critic, data, ppo, MB)
    assert second["ppo_critic/value_loss/avg"] < first["ppo_critic/value_loss/avg"]
    assert first["ppo_critic/n_valid_tokens"] == (~batch["prompt_mask"]).sum()


# --- two ranks over gloo --------------------------------------------------------------------------------------


def _rank_main(
    rank: int, comm: str, backend: str, mode: str, model_dir: str, batch_path: str, out_dir: str
) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(rank, 2, Path(out_dir) / "dist_init", backend=comm, timeout_s=120)
    try:
        engine = make_engine(model_config(model_dir, backend=backend), total_train_steps=10)
        part = read_batch(batch_path, seqs=RANK_SEQS[rank])
        ppo = replace(PPO, loss_agg_mode=mode)
        stats = actor_train_step(engine, part, ppo, MicroBatchSpec(max_tokens_per_mb=12 + 10 * rank))
        stats["optimizer_bytes"] = optimizer_bytes(engine)
        torch.save(weights(engine), Path(out_dir) / f"rank{rank}.pt")
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(stats))
        dist.barrier()  # no rank leaves while another's last collective is in flight
    finally:
        dist.destroy()


def optimizer_bytes(engine) -> int:
    """The bytes of optimizer state this rank holds (its shards' local tensors)."""
    state = engine.optimizer.state.values()
    local = [getattr(t, "_local_tensor", t) for s in state for k, t in s.items() if k != "step"]
    return sum(t.numel() * t.element_size() for t in local)


# make test-gpu: a one-GPU machine skips it
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")]


# Each rank cuts its part into micro-batches of its own size: a loss_agg_mode's normaliser must be the
# minibatch's, over ranks and micro-batches, for the two ranks to take the one rank's step.
@pytest.mark.parametrize("comm", ["gloo", pytest.param("nccl", marks=TWO_GPUS)])
@pytest.mark.parametrize(
    "backend, mode", [("fsdp", "token-mean"), ("torch", "token-mean"), ("fsdp", "seq-mean-token-mean")]
)
def test_two_ranks_match_one_rank_on_the_whole_batch(tiny_model_dir, batch, tmp_path, backend, mode, comm):
    write_batch(tmp_path / "batch.h5", batch)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (comm, backend, mode, str(tiny_model_dir), str(tmp_path / "batch.h5"), str(tmp_path))
    mp.spawn(_rank_main, args=args, nprocs=2)

    single = make_engine(model_config(tiny_model_dir, backend="torch"), total_train_steps=10)
    single_stats = actor_train_step(single, batch, replace(PPO, loss_agg_mode=mode), MB)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, tensor in weights(single).items():
        if name not in ranks[0]:  # a tied weight, published once by a sharded engine
            continue
        torch.testing.assert_close(ranks[0][name], ranks[1][name], atol=0, rtol=0)
        torch.testing.assert_close(ranks[0][name], tensor, atol=1e-5, rtol=0)
    whole = optimizer_bytes(single)  # every rank holds it all, or (fsdp) about half of it each
    per_rank = [s.pop("optimizer_bytes") for s in stats]
    assert per_rank == ([whole, whole] if backend == "torch" else pytest.approx([whole / 2] * 2, rel=0.05))
    assert stats[0] == stats[1]
    assert stats[0].keys() == single_stats.keys()
    for key in (
        "task_reward/avg",
        "advantages/max",
        "actor_loss/avg",
        "n_valid_tokens",
        "grad_norm",
        "seq_len/min",
    ):
        assert stats[0][f"ppo_actor/{key}"] == pytest.approx(single_stats[f"ppo_actor/{key}"], abs=1e-5), key
