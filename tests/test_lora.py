"""LoRA (actor.lora): the actor trains PEFT adapters instead of its weights on the fsdp backend; what leaves the
trainer as HF weights is the base with the adapters merged in, the policy the trainer computes; with
weight_update_mode adapter the adapters themselves go to the servers (tests/test_lora_serving.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal_hpc.cli import main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.config.schema import ActorConfig, LoraConfig, MicroBatchSpec, OptimizerConfig
from areal_hpc.control.rundir import run_dir_of
from areal_hpc.launch.local import run_local
from areal_hpc.launch.run_status import saved_line
from areal_hpc.monitor.stats import read_stats
from areal_hpc.train.backends.fsdp.engine import FSDPEngine
from areal_hpc.train.microbatch import micro_batches
from areal_hpc.weights.adapter import is_adapter_dir
from tests.helpers import REPO_ROOT
from tests.test_checkpoint_evals import EVAL
from tests.test_fsdp_engine import alone, nll, packed
from tests.test_recover_local import straight_and_killed

REWARD = "ppo_actor/task_reward/avg"
TOY = REPO_ROOT / "configs" / "toy-cpu.yaml"


def lora_actor(path, rank=4, targets=("all-linear",)) -> ActorConfig:
    return ActorConfig(
        path=str(path), dtype="float32", gradient_checkpointing=False,
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0),
        lora=LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=list(targets)),
    )  # fmt: skip


def step(engine: FSDPEngine, batch) -> None:
    engine.train_minibatch(micro_batches(batch, MicroBatchSpec(max_tokens_per_mb=32)), nll)


def test_only_the_adapters_train_and_the_base_weights_stay_bit_identical(tiny_model_dir):
    engine = FSDPEngine(lora_actor(tiny_model_dir), total_train_steps=2)
    before = {n: p.detach().clone() for n, p in engine.net.model.named_parameters()}
    trained = [n for n, p in engine.net.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    step(engine, packed())
    after = dict(engine.net.model.named_parameters())
    for name, old in before.items():
        changed = not torch.equal(old, after[name].detach())
        assert changed == (name in trained), name
    # The optimizer holds the adapters' state alone.
    assert {id(p) for p in engine.optimizer.state} == {id(after[n]) for n in trained}


def test_a_bf16_actors_frozen_base_stays_bf16_and_its_adapters_train_in_float32(tiny_model_dir):
    cfg = lora_actor(tiny_model_dir)
    cfg.dtype = "bfloat16"
    engine = FSDPEngine(cfg, total_train_steps=2)
    dtypes = {n: p.dtype for n, p in engine.net.model.named_parameters()}
    assert all(d == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, d in dtypes.items())
    step(engine, packed())
    assert all(s["exp_avg"].dtype == torch.float32 for s in engine.optimizer.state.values())
    published = dict(engine.hf_weights())  # the merged weights, in the compute dtype
    assert all(t.dtype == torch.bfloat16 for t in published.values())


def test_a_fresh_adapter_publishes_the_base_weights_exactly(tiny_model_dir):
    engine = FSDPEngine(lora_actor(tiny_model_dir), total_train_steps=1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    published = dict(engine.hf_weights())
    assert set(engine.hf_params()) == set(published)
    assert published.keys() <= base.keys() and "model.layers.0.self_attn.q_proj.weight" in published
    assert all(torch.equal(t, base[n]) for n, t in published.items())  # B starts at zero


def test_the_merged_weights_are_the_policy_the_trainer_computes(tiny_model_dir, tmp_path):
    engine = FSDPEngine(
        lora_actor(tiny_model_dir, targets=("q_proj", "v_proj", "down_proj")), total_train_steps=2
    )
    batch = packed()
    step(engine, batch)
    step(engine, batch)
    saved = engine.save_hf(tmp_path / "merged")
    assert not any("lora" in name for name in load_file(saved / "model.safetensors"))
    mine = engine.logprobs(batch, 1.0, MicroBatchSpec())
    torch.testing.assert_close(mine, alone(saved, batch, 1.0), rtol=1e-5, atol=1e-5)
    base = alone(tiny_model_dir, batch, 1.0)
    assert not torch.allclose(mine, base, atol=1e-3)  # it did train
    # The reference policy of the KL penalty: the same engine with its adapters off is the base model.
    with engine.adapters_off():
        torch.testing.assert_close(engine.logprobs(batch, 1.0, MicroBatchSpec()), base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.logprobs(batch, 1.0, MicroBatchSpec()), mine)  # and on again


def test_a_recover_checkpoint_keeps_the_adapters_and_their_optimizer_state_alone(tiny_model_dir):
    batch = packed()
    engine = FSDPEngine(lora_actor(tiny_model_dir), total_train_steps=3)
    step(engine, batch)
    state = copy.deepcopy(engine.state_dict())  # as written to disk: not the live tensors the next step moves
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    resumed = FSDPEngine(lora_actor(tiny_model_dir), total_train_steps=3)  # the base from the model's path
    resumed.load_state_dict(state)
    resumed.load_schedule_state(engine.schedule_state())
    step(engine, batch)
    step(resumed, batch)
    spec = MicroBatchSpec()
    torch.testing.assert_close(
        resumed.logprobs(batch, 1.0, spec), engine.logprobs(batch, 1.0, spec), rtol=0, atol=0
    )
    with pytest.raises(KeyError, match="lacks .* adapter weight"):
        resumed.load_state_dict({"model": {}, "optimizer": state["optimizer"]})


def test_lora_is_refused_where_it_would_not_train(toy):
    with pytest.raises(ConfigError, match="'actor.lora.rank' 8: LoRA trains on the fsdp backend"):
        load_config([TOY], toy.overrides("x", 1, "actor.lora.rank=8", "actor.backend=megatron"))
    with pytest.raises(ConfigError, match="actor.lora.alpha.*actor.lora.rank 0"):
        load_config([TOY], toy.overrides("x", 1, "actor.lora.alpha=32"))
    with pytest.raises(ValueError, match="no_such_proj"):
        FSDPEngine(lora_actor(toy.model_dir, targets=("no_such_proj",)), total_train_steps=1)


def test_a_grpo_run_publishes_its_adapters_and_its_servers_run_them(toy):
    # Unnormalised advantages: the untrained model's constant reward then moves it (as in test_pinned_stats).
    # A KL penalty: the reference is the actor's base, served by the actor with its adapters off.
    cfg = toy.config("lora", 3, "actor.lora.rank=8", "actor.lora.alpha=16", "ppo.adv_norm=false",
                     "ppo.group_adv_norm=false", "ppo.kl_ctl=0.05", "weight_update_mode=adapter", *EVAL,
                     "exp_ctrl.save_freq_steps=null")  # fmt: skip
    assert run_local(cfg) == 0
    run = run_dir_of(cfg)
    steps = [r for r in read_stats(run.stats) if REWARD in r]
    assert len(steps) == 3 and all(np.isfinite(r["ppo_actor/grad_norm"]) for r in steps)
    assert all("timeperf/ref_inf" in r for r in steps)
    assert "loaded ['actor']" in (run.attempt_logs(0) / "trainer0.log").read_text()  # no reference copy
    # Synchronous: the server sampled each step under the adapter whose logprobs the trainer recomputed.
    for r in steps:
        low, high = r["ppo_actor/behave_imp_weight/min"], r["ppo_actor/behave_imp_weight/max"]
        assert low == pytest.approx(1.0, abs=1e-3) and high == pytest.approx(1.0, abs=1e-3)
    # Each version went out as an adapter, far smaller than the model; only the newest folder is left.
    model_bytes = sum(f.stat().st_size for f in Path(toy.model_dir).glob("*.safetensors"))
    assert all(0 < r["weight_sync/bytes"] < model_bytes / 2 for r in steps if "weight_sync/bytes" in r)
    assert [p.name for p in run.weights.iterdir()] == ["adapter-v3"]
    # The checkpoint is the adapters; it was evaluated on its base, and exports as a merged model.
    (ckpt,) = sorted((run.checkpoints / "actor").iterdir())
    assert is_adapter_dir(ckpt)
    assert any("eval/math_500/greedy_acc" in r for r in read_stats(run.stats))
    routes = [
        e.get("name")
        for f in run.timeline.glob("*.jsonl")
        for e in map(json.loads, f.read_text().splitlines())
    ]
    assert (
        routes.count("load_lora_adapter") == 3 and routes.count("unload_lora_adapter") >= 1
    )  # in the background
    assert main(["export", str(run.root), "--merge"]) == 0
    assert saved_line(run).startswith(f"{ckpt},")  # the checkpoint, not the export beside it
    merged = load_file(ckpt.with_name(ckpt.name + "-merged") / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32).state_dict()
    assert merged.keys() <= base.keys()
    assert not all(torch.equal(merged[n].float(), base[n]) for n in merged)  # the adapters moved the weights


@pytest.mark.slow
def test_colocated_lora_steps_are_the_decoupled_ones(toy):
    """Colocated servers keep their base weights and give back their KV cache alone while the trainer trains;
    the adapters reach them as they reach servers of their own: the same seed, the same rewards."""
    lora = ("actor.lora.rank=8", "actor.lora.alpha=16", "ppo.adv_norm=false", "weight_update_mode=adapter")
    decoupled = toy.config("lora-decoupled", 3, *lora)
    colocated = toy.config("lora-colocated", 3, *lora, "cluster.n_nodes=1", "allocation_mode=d1p1m1")
    assert run_local(decoupled) == 0 and run_local(colocated) == 0
    apart, shared = (
        [r for r in read_stats(run_dir_of(c).stats) if REWARD in r] for c in (decoupled, colocated)
    )
    assert [r[REWARD] for r in shared] == [r[REWARD] for r in apart]
    assert all(r["timeperf/release_memory"] > 0 for r in shared)


@pytest.mark.slow
def test_a_lora_run_killed_mid_run_resumes_with_its_adapters_and_ends_as_an_uninterrupted_run(toy, tmp_path):
    # The setting of test_recover_local's bit-for-bit test: the controller killed (kill -9) at step 3, the
    # recover checkpoint used step 2's, at an epoch boundary.
    ten = tmp_path / "ten.jsonl"
    ten.write_text("".join((toy.data / "train.jsonl").read_text().splitlines(keepends=True)[:10]))
    common = [
        "actor.lora.rank=8", "actor.lora.alpha=16", "ppo.adv_norm=false", "weight_update_mode=adapter",
        f"dataset.path={ten}", "exp_ctrl.total_train_epochs=3", "exp_ctrl.benchmark_steps=null",
        "exp_ctrl.ckpt_freq_steps=2", "recover_after=0", "dataset.valid_path=null",
    ]  # fmt: skip
    straight, run = straight_and_killed(toy, "lora-", *common)
    assert "resumes from recover checkpoint" in (run.attempt_logs(1) / "controller.log").read_text()
    assert [p.name for p in run.weights.iterdir()] == ["adapter-v6"]  # the first attempt's are gone
    # The resumed server got the restored adapters before the first new rollout, and every later version:
    # the last adapters are the uninterrupted run's. Not bit for bit as full weights are: the two LoRA runs
    # differ by ~1e-8 from step 2 on, before the kill (round-off whose source is not found yet), a lost or
    # stale adapter by ~1e-2.
    (a,), (b,) = (sorted((r.checkpoints / "actor").iterdir())[-1:] for r in (straight, run))
    a, b = (load_file(p / "adapter_model.safetensors") for p in (a, b))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_an_asynchronous_lora_run_generates_ahead_under_older_adapters_within_the_bound(toy):
    cfg = toy.config("lora-async", 4, "actor.lora.rank=8", "actor.lora.alpha=16", "weight_update_mode=adapter",
                     "async_rl=true", "max_head_offpolicyness=2", "ppo.gen.max_new_tokens=16")  # fmt: skip
    assert run_local(cfg) == 0
    steps = [r for r in read_stats(run_dir_of(cfg).stats) if "ppo_actor/head_offpolicyness/max" in r]
    assert len(steps) == 4 and all(np.isfinite(r["ppo_actor/grad_norm"]) for r in steps)
    # Each answer's versions are those of the adapters its requests named (gen/adapters.py): trained on older
    # adapters' answers, never older than the bound.
    heads = [r["ppo_actor/head_offpolicyness/max"] for r in steps]
    assert max(heads) >= 1 and max(heads) <= 2, heads
    assert all(r["ppo_actor/tail_offpolicyness/max"] <= r["ppo_actor/head_offpolicyness/max"] for r in steps)
