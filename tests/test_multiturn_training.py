"""Multi-turn episodes on the training side: tokens the policy did not sample (prompt, tool results, user turns)
sit in the middle of a sequence; groups have a variable number of rows (a row per model turn); each sampled
token carries the weight version it was sampled with."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from areal_hpc.algo import actor_loss, compute_advantages
from areal_hpc.algo.corrections import Correction
from areal_hpc.config import load_config
from areal_hpc.config.schema import MicroBatchSpec, OptimizerConfig, PPOConfig, TrainedModelConfig
from areal_hpc.data.batch import write_batch
from areal_hpc.master.buffer import Buffer
from areal_hpc.master.dispatch import split_by_rank
from areal_hpc.master.graph import ALL_MFCS, awaited, build_graph
from areal_hpc.master.loop import Master, file_rows, sample_metas
from areal_hpc.master.sources import StepBatch
from areal_hpc.train.backends import make_engine
from areal_hpc.train.interfaces import actor_inference, actor_train_step
from areal_hpc.train.numerics import token_logprobs

MB = MicroBatchSpec(max_tokens_per_mb=32)
# Group-normalised advantages, a KL penalty, dual clip and two minibatches: every path a masked token could leak
# through.
PPO = PPOConfig(ppo_n_minibatches=2, kl_ctl=0.1, group_adv_norm=True, c_clip=3.0)
VOCAB = 1024  # the tiny model's

# Episodes as segments: (sampled by the policy, tokens, weight version). Unsampled segments are the prompt,
# tool results and user turns; the last episode ends on a tool result (its turn limit was reached).
EPISODES = [
    [(False, 4, -1), (True, 3, 2), (False, 3, -1), (True, 3, 3)],
    [(False, 3, -1), (True, 2, 1), (False, 2, -1), (True, 4, 2), (False, 2, -1), (True, 2, 3)],
    [(False, 5, -1), (True, 4, 3), (False, 3, -1), (True, 2, 3)],
    [(False, 2, -1), (True, 3, 0), (False, 4, -1), (True, 3, 1), (False, 2, -1)],
]


def multiturn_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """The rollout's packed arrays of EPISODES (two groups of two), without logprobs."""
    rng = np.random.default_rng(seed)
    lengths = [sum(n for _, n, _ in episode) for episode in EPISODES]
    sampled = np.concatenate([np.full(n, s) for episode in EPISODES for s, n, _ in episode])
    versions = np.concatenate([np.full(n, v) for episode in EPISODES for _, n, v in episode])
    return {
        "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "packed_input_ids": rng.integers(3, VOCAB, sum(lengths)),
        "prompt_mask": ~sampled,
        "rewards": np.asarray([5.0, -5.0, -5.0, 5.0], dtype=np.float32),
        "seq_no_eos_mask": np.asarray([False, False, False, True]),
        "group_ids": np.asarray([0, 0, 1, 1], dtype=np.int64),
        "version_start": np.asarray([2, 1, 3, 0], dtype=np.int64),
        "version_end": np.asarray([3, 3, 3, 1], dtype=np.int64),
        "token_versions": versions.astype(np.int64),
    }


def on_masked(batch: dict, keys: tuple[str, ...], seed: int = 1) -> dict[str, np.ndarray]:
    """`batch` with `keys` changed to other (valid logprob) values on the tokens the policy did not sample."""
    rng = np.random.default_rng(seed)
    out = dict(batch)
    for key in keys:
        noise = rng.uniform(-20.0, 0.0, batch[key].shape).astype(batch[key].dtype)
        out[key] = np.where(batch["prompt_mask"], noise, batch[key])
    return out


# --- the algorithm on a multi-turn batch ----------------------------------------------------------------------


def advantages_of(batch: dict) -> dict[str, torch.Tensor]:
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    return compute_advantages(
        scores=t["rewards"],
        prompt_mask=t["prompt_mask"],
        cu_seqlens=t["cu_seqlens"],
        seq_no_eos_mask=t["seq_no_eos_mask"],
        logp_behav=t["packed_logprobs"],
        logp_ref=t["packed_ref_logprobs"],
        kl_ctl=0.1,
        group_adv_norm=True,
        group_ids=t["group_ids"],
    )


def with_random_logprobs(batch: dict, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logprobs = {k: rng.uniform(-3.0, 0.0, len(batch["prompt_mask"])).astype(np.float32) for k in ("b", "r")}
    behaviour = np.where(batch["prompt_mask"], 0.0, logprobs["b"]).astype(np.float32)  # 0 where not sampled
    return {**batch, "packed_logprobs": behaviour, "packed_ref_logprobs": logprobs["r"]}


def test_the_loss_mask_leaves_out_every_unsampled_token_and_the_kl_reward_is_zero_on_them():
    batch = with_random_logprobs(multiturn_batch())
    adv = advantages_of(batch)
    sampled = torch.from_numpy(~batch["prompt_mask"])
    assert torch.equal(adv["loss_mask"], sampled)  # no episode starts with a sampled token
    assert (adv["kl_rewards"][~sampled] == 0).all() and (adv["kl_rewards"][sampled] != 0).all()
    assert (adv["advantages"][~sampled] == 0).all()
    changed = advantages_of(on_masked(batch, ("packed_logprobs", "packed_ref_logprobs")))
    for key in ("loss_mask", "rewards", "kl_rewards", "advantages", "returns"):
        assert torch.equal(changed[key], adv[key]), key


def loss_and_logit_grad(batch: dict, advantages: torch.Tensor, logits: torch.Tensor):
    """actor_loss (decoupled, dual clip) of logprobs from `logits`; its statistics and d loss / d logits."""
    logits = logits.clone().requires_grad_(True)
    cu, ids = torch.from_numpy(batch["cu_seqlens"]), torch.from_numpy(batch["packed_input_ids"])
    loss, stats = actor_loss(
        token_logprobs(logits, ids, cu),
        torch.from_numpy(batch["packed_logprobs"]),
        advantages,
        torch.from_numpy(~batch["prompt_mask"]),
        c_clip=3.0,
        proximal_logprobs=torch.from_numpy(batch["proximal_logprobs"]),
        correction=Correction(upper=5.0),
    )
    loss.backward()
    return loss.detach(), stats, logits.grad


def summary(stats: dict) -> dict:
    """What statistics report: masked values where their mask holds, and scalars."""
    return {k: v[0][v[1]].tolist() if isinstance(v, tuple) else float(v) for k, v in stats.items()}


def test_the_logits_gradient_ignores_the_logprobs_and_advantages_of_unsampled_tokens():
    batch = with_random_logprobs(multiturn_batch())
    batch["proximal_logprobs"] = (batch["packed_ref_logprobs"] + 0.1).astype(np.float32)
    logits = torch.randn(len(batch["prompt_mask"]), VOCAB, generator=torch.Generator().manual_seed(0))
    advantages = advantages_of(batch)["advantages"]
    loss, stats, grad = loss_and_logit_grad(batch, advantages, logits)

    keys = ("packed_logprobs", "proximal_logprobs", "packed_ref_logprobs")
    changed = on_masked(batch, keys)
    masked = torch.from_numpy(batch["prompt_mask"])
    noise = torch.randn(advantages.shape, generator=torch.Generator().manual_seed(1))
    other_advantages = torch.where(masked, noise, advantages)
    loss2, stats2, grad2 = loss_and_logit_grad(changed, other_advantages, logits)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
    assert summary(stats2) == summary(stats)
    # Logits row r predicts token r + 1: rows whose next token was not sampled get no gradient (of the others,
    # clipped tokens and those over the behaviour weight cap get none either).
    predicts_sampled = torch.zeros(len(masked), dtype=torch.bool)
    predicts_sampled[:-1] = ~masked[1:]
    predicts_sampled[torch.from_numpy(batch["cu_seqlens"][1:] - 1)] = False  # a sequence's last row
    assert (grad[~predicts_sampled] == 0).all() and grad.abs().sum() > 0


# --- the actor's train step on a real engine ------------------------------------------------------------------


def engine_of(model_dir):
    opt = OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0)
    cfg = TrainedModelConfig(
        path=str(model_dir), backend="torch", dtype="float32", gradient_checkpointing=False, optimizer=opt
    )
    return make_engine(cfg, total_train_steps=10)


@pytest.fixture(scope="module")
def trained_batch(tiny_model_dir) -> dict[str, np.ndarray]:
    """multiturn_batch with the current policy's logprobs: proximal, behaviour (perturbed: stale) and
    reference (perturbed otherwise)."""
    batch = multiturn_batch()
    proximal = actor_inference(engine_of(tiny_model_dir), batch, MB, 1.0)["proximal_logprobs"]
    rng = np.random.default_rng(3)
    behaviour = np.where(batch["prompt_mask"], 0.0, proximal + rng.normal(0, 0.1, proximal.shape))
    reference = proximal + rng.normal(0, 0.1, proximal.shape)
    logprobs = {"proximal_logprobs": proximal, "packed_logprobs": behaviour, "packed_ref_logprobs": reference}
    return batch | {k: v.astype(np.float32) for k, v in logprobs.items()}


class MaskedEntropyShift:
    """A real engine whose entropy output is shifted on the tokens outside the loss mask; it records the entropy
    and loss mask of every micro-batch."""

    def __init__(self, engine, shift: float):
        self.engine, self.shift, self.seen = engine, shift, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_minibatch(self, micro_batches, loss_fn, temperature: float = 1.0, skip=None):
        def shifted(out, mb):
            entropy = torch.where(mb["loss_mask"], out["entropy"], out["entropy"] + self.shift)
            self.seen.append((entropy.detach().clone(), mb["loss_mask"].clone()))
            return loss_fn({**out, "entropy": entropy}, mb)

        return self.engine.train_minibatch(micro_batches, shifted, temperature, skip)


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in engine.hf_weights()}


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_train_step_does_not_depend_on_unsampled_tokens(tiny_model_dir, trained_batch, decoupled):
    ppo = replace(PPO, use_decoupled_loss=decoupled)
    plain = MaskedEntropyShift(engine_of(tiny_model_dir), shift=0.0)
    stats = actor_train_step(plain, trained_batch, ppo, MB, global_step=4)
    keys = ("packed_logprobs", "proximal_logprobs", "packed_ref_logprobs")
    other = MaskedEntropyShift(engine_of(tiny_model_dir), shift=7.0)
    other_stats = actor_train_step(other, on_masked(trained_batch, keys), ppo, MB, global_step=4)
    assert other_stats == stats
    after = weights(plain.engine)
    assert all(torch.equal(v, after[k]) for k, v in weights(other.engine).items())

    # The entropy statistic averages the loss-mask tokens only.
    entropy = torch.cat([e[m] for e, m in other.seen]).double()
    assert stats["ppo_actor/entropy/avg"] == pytest.approx(entropy.mean().item(), rel=1e-12)
    assert stats["ppo_actor/n_valid_tokens"] == (~trained_batch["prompt_mask"]).sum()
    assert stats["ppo_actor/n_tokens"] == len(trained_batch["prompt_mask"])


# --- per-token versions ---------------------------------------------------------------------------------------


def test_token_offpolicyness_is_the_lag_of_the_trained_tokens(tiny_model_dir, trained_batch):
    stats = actor_train_step(engine_of(tiny_model_dir), trained_batch, PPO, MB, global_step=5)
    sampled = ~trained_batch["prompt_mask"]
    lag = 5 - trained_batch["token_versions"][sampled]  # 5 - versions 0..3 of the sampled segments
    assert stats["ppo_actor/token_offpolicyness/avg"] == pytest.approx(lag.mean(), rel=1e-12)
    assert (stats["ppo_actor/token_offpolicyness/max"], stats["ppo_actor/token_offpolicyness/min"]) == (5, 2)
    assert stats["ppo_actor/head_offpolicyness/max"] == 5  # the per-sequence statistics stay

    without = {k: v for k, v in trained_batch.items() if k != "token_versions"}
    stats = actor_train_step(engine_of(tiny_model_dir), without, PPO, MB, global_step=5)
    assert not any("token_offpolicyness" in k for k in stats) and "ppo_actor/head_offpolicyness/avg" in stats
    stats = actor_train_step(engine_of(tiny_model_dir), trained_batch, PPO, MB)  # no global step
    assert not any("offpolicyness" in k for k in stats)


def test_a_trained_token_without_a_version_is_refused(tiny_model_dir, trained_batch):
    versions = trained_batch["token_versions"].copy()
    versions[np.flatnonzero(~trained_batch["prompt_mask"])[0]] = -1
    with pytest.raises(ValueError, match="1 trained tokens have no weight version"):
        actor_train_step(engine_of(tiny_model_dir), trained_batch | {"token_versions": versions}, PPO, MB,
                         global_step=5)  # fmt: skip


def test_token_versions_and_routed_experts_are_optional_inputs_of_the_train_calls():
    actor_gen, actor_train = ALL_MFCS[0], next(m for m in ALL_MFCS if m.name == "actor_train")
    optional = ("token_versions", "packed_routed_experts")  # multi-turn episodes; routing replay
    for key in optional:
        assert key in actor_gen.outputs and key in actor_train.inputs
    assert awaited(actor_train).inputs == tuple(k for k in actor_train.inputs if k not in optional)
    actor_inf = next(
        m for m in ALL_MFCS if m.name == "actor_inf"
    )  # recomputed logprobs replay the routing too
    assert awaited(actor_inf).inputs == ("packed_input_ids",) != actor_inf.inputs


# --- the master: groups of variable size ----------------------------------------------------------------------

# Rows of a per-turn export: group "a" has one row, "b" three, "c" two; rows of a group need not be adjacent.
GROUP_IDS = [1, 0, 1, 2, 1, 2]
LENGTHS = [4, 9, 5, 6, 3, 5]


def per_turn_file(path, group_ids=GROUP_IDS) -> str:
    """A batch file with the rollout's keys (no token_versions), its rows in groups as `group_ids` say."""
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64)
    n, t = len(LENGTHS), int(cu[-1])
    arrays = {
        "cu_seqlens": cu,
        "packed_input_ids": np.arange(t),
        "packed_logprobs": np.zeros(t, np.float32),
        "prompt_mask": np.arange(t) % 2 == 0,
        "seq_no_eos_mask": np.zeros(n, bool),
        "group_ids": np.asarray(group_ids, np.int64),
        "version_start": np.zeros(n, np.int64),
        "version_end": np.zeros(n, np.int64),
        "rewards": np.ones(n, np.float32),
        "success": np.ones(n, np.float32),
    }
    return str(write_batch(path, arrays))


def trainer_graph():
    cfg = load_config(
        overrides=["ppo.kl_ctl=0", "ppo.recompute_logprob=false", "ppo.use_decoupled_loss=false"]
    )
    return build_graph(cfg, trainer_only=True)  # actor_train alone


def buffered(mfcs, batch: StepBatch) -> tuple[Buffer, int]:
    """Master.add of `batch` into a buffer of `mfcs` (the master's buffer, without the rest of a master)."""
    master = SimpleNamespace(buffer=Buffer(mfcs))
    return master.buffer, Master.add(master, batch, birth=1.0)


def test_a_step_with_groups_of_one_three_and_two_rows_is_buffered_and_split(tmp_path):
    path = per_turn_file(tmp_path / "rollout.h5")
    batch = StepBatch([(path, ["a", "b", "c"])], [("a", 0), ("b", 0), ("c", 0)])
    buffer, n_samples = buffered([awaited(m) for m in trainer_graph()], batch)
    assert n_samples == 6 and len(buffer) == 6
    samples = buffer.ready(
        "actor_train", n_samples
    )  # without token_versions, which actor_train reads if there
    assert samples is not None
    waiting, _ = buffered(trainer_graph(), batch)  # a buffer that waited for every input would wait for ever
    assert waiting.ready("actor_train", 1) is None
    by_id = {s.sample_id: s for s in samples}
    assert sorted(by_id) == ["a/0", "b/0", "b/1", "b/2", "c/0", "c/1"]
    rows = {sid: s.keys["packed_input_ids"] for sid, s in by_id.items()}
    assert rows == {"b/0": (path, 0), "a/0": (path, 1), "b/1": (path, 2), "c/0": (path, 3), "b/2": (path, 4),
                    "c/1": (path, 5)}  # fmt: skip
    assert [by_id[f"b/{i}"].seqlen for i in range(3)] == [4, 5, 3] and by_id["a/0"].group == "a"

    parts = split_by_rank(samples, 2)
    assert sorted(s.sample_id for part in parts for s in part) == sorted(by_id)
    groups_of = [{s.group for s in part} for part in parts]
    assert all(groups_of) and not groups_of[0] & groups_of[1]  # every rank has whole groups, none shared
    tokens = sorted(sum(s.seqlen for s in part) for part in parts)
    assert tokens == [12, 20]  # b (12 tokens) alone; a and c (9 + 11) together


def test_files_without_group_ids_have_a_row_per_group_and_a_store_file_is_one_group(tmp_path):
    sft = {
        "cu_seqlens": np.asarray([0, 3, 7]),
        "packed_input_ids": np.arange(7),
        "prompt_mask": np.ones(7, bool),
    }
    sft_path = str(write_batch(tmp_path / "sft.h5", sft))
    group_ids, lengths, keys = file_rows(sft_path)
    assert (
        group_ids.tolist() == [0, 1]
        and lengths == [3, 4]
        and sorted(keys) == ["packed_input_ids", "prompt_mask"]
    )
    store_path = per_turn_file(
        tmp_path / "store.h5", group_ids=[0] * 6
    )  # a prompt's group, named by the file
    metas = sample_metas(store_path, ["g7"], *file_rows(store_path), birth=2.0)
    assert [m.sample_id for m in metas] == [f"g7/{i}" for i in range(6)] and {m.group for m in metas} == {
        "g7"
    }


def test_group_ids_outside_the_files_groups_are_refused(tmp_path):
    path = per_turn_file(tmp_path / "rollout.h5")
    with pytest.raises(ValueError, match=r"group_ids \[2\] are none of its 2 groups"):
        sample_metas(path, ["a", "b"], *file_rows(path), birth=1.0)
    with pytest.raises(ValueError, match="5 group_ids for 6 rows"):
        sample_metas(path, ["a", "b", "c"], GROUP_IDS[:5], LENGTHS, [], birth=1.0)
