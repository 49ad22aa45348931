"""Rewards, GAE and advantage normalisation: hand-computed cases and a naive float64 reference."""

import math
import random

import pytest
import torch

from areal_hpc.algo.advantages import (
    compute_advantages,
    dist_sum,
    gae,
    group_masked_normalize,
    masked_normalize,
    response_mask,
    token_rewards,
)
from areal_hpc.algo.packing import AlgoInputError

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


# --- a random packed batch and naive per-sequence references ------------------------------------------


def random_batch(seed: int, n_seqs: int | None = None):
    rng = random.Random(seed)
    n_seqs = n_seqs or rng.randint(1, 6)
    lengths = [rng.randint(2, 12) for _ in range(n_seqs)]
    prompt_lens = [rng.randint(1, n - 1) for n in lengths]
    total = sum(lengths)
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(n_seqs)])
    prompt_mask = torch.tensor([k < p for n, p in zip(lengths, prompt_lens, strict=True) for k in range(n)])
    return {
        "cu": cu,
        "prompt_mask": prompt_mask,
        "rewards": torch.randn(total, dtype=F64, generator=torch.Generator().manual_seed(seed)),
        "values": torch.randn(total, dtype=F64, generator=torch.Generator().manual_seed(seed + 1)),
        "no_eos": torch.tensor([rng.random() < 0.5 for _ in range(n_seqs)]),
    }


def naive_gae(rewards, values, cu, no_eos, gamma, lam):
    """Textbook GAE, one sequence at a time: states s_0..s_{L-1}, action k leads s_{k-1} -> s_k."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        v = [0.0 if values is None else float(values[i]) for i in range(s, e)]
        r = [float(rewards[i]) for i in range(s, e)]
        running = 0.0
        for k in reversed(range(1, e - s)):
            terminal = k == e - s - 1 and not bool(no_eos[b])
            next_value = 0.0 if terminal else v[k]
            delta = r[k] + gamma * next_value - v[k - 1]
            running = delta + gamma * lam * running
            adv[s + k], ret[s + k] = running, running + v[k - 1]
    return t(adv), t(ret)


def naive_normalize(xs, keep, eps=1e-5):
    vals = [x for x, m in zip(xs, keep, strict=True) if m]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals))
    return [(x - mean) / (std + eps) if m else 0.0 for x, m in zip(xs, keep, strict=True)]


# --- masks and rewards ---------------------------------------------------------------------------------


def test_response_mask_is_response_tokens_only():
    prompt_mask = torch.tensor([True, True, False, True, False, False])
    # The second sequence's first token (index 3) is a prompt token; index 0 of a sequence never counts.
    assert response_mask(prompt_mask, torch.tensor([0, 3, 6])).tolist() == [
        False,
        False,
        True,
        False,
        True,
        True,
    ]


def kl_case():
    cu = torch.tensor([0, 3, 7])
    loss_mask = torch.tensor([False, False, True, False, True, True, True])
    logp_behav = t([0, -1, -2, 0, -1, -0.5, -3])
    logp_ref = t([0, -1.5, -1, 0, -1, -1, -2])
    return cu, loss_mask, logp_behav, logp_ref


def test_token_rewards_hand_case():
    cu, loss_mask, logp_behav, logp_ref = kl_case()
    rewards, kl = token_rewards(
        t([30.0, -5.0]),
        loss_mask,
        cu,
        torch.tensor([False, True]),
        logp_behav=logp_behav,
        logp_ref=logp_ref,
        kl_ctl=0.5,
        max_reward_clip=20.0,
    )
    # -0.5 * (behav - ref) on response tokens: 0.5, 0, -0.25, 0.5; the prompt token at 1 gets nothing.
    assert kl.tolist() == [0, 0, 0.5, 0, 0, -0.25, 0.5]
    # Score 30 is clipped to 20 and added at index 2; -5 is added at index 6.
    assert rewards.tolist() == [0, 0, 20.5, 0, 0, -0.25, -4.5]


def test_mask_no_eos_with_zero_drops_the_score_of_truncated_sequences():
    cu, loss_mask, logp_behav, logp_ref = kl_case()
    rewards, _ = token_rewards(
        t([30.0, -5.0]),
        loss_mask,
        cu,
        torch.tensor([False, True]),
        logp_behav=logp_behav,
        logp_ref=logp_ref,
        kl_ctl=0.5,
        mask_no_eos_with_zero=True,
    )
    assert rewards.tolist() == [0, 0, 20.5, 0, 0, -0.25, 0.5]


def test_token_rewards_without_reference_model():
    rewards, kl = token_rewards(
        t([3.0]), torch.tensor([False, True, True]), torch.tensor([0, 3]), torch.tensor([False]), kl_ctl=0.0
    )
    assert rewards.tolist() == [0, 0, 3] and kl.tolist() == [0, 0, 0]
    with pytest.raises(AlgoInputError, match="kl_ctl=0.1 needs"):
        token_rewards(
            t([3.0]), torch.tensor([False, True, True]), torch.tensor([0, 3]), torch.tensor([False])
        )


# --- GAE -----------------------------------------------------------------------------------------------


def test_gae_hand_case_with_and_without_bootstrap():
    # One sequence: token 0 is the prompt, actions at 1..3; gamma=0.9, lambda=0.5 (gamma*lambda=0.45).
    rewards, values, cu = t([0, 0, 0, 1]), t([0.5, 0.6, 0.7, 0.8]), torch.tensor([0, 4])
    # With EOS: deltas 0.9*0.6-0.5=0.04, 0.9*0.7-0.6=0.03, 1-0.7=0.3.
    adv, ret = gae(rewards, values, cu, torch.tensor([False]), discount=0.9, gae_lambda=0.5)
    assert adv.tolist() == pytest.approx([0, 0.11425, 0.165, 0.3])
    assert ret.tolist() == pytest.approx([0, 0.61425, 0.765, 1.0])
    # Truncated: the last action bootstraps from V=0.8, delta 1+0.9*0.8-0.7=1.02.
    adv, ret = gae(rewards, values, cu, torch.tensor([True]), discount=0.9, gae_lambda=0.5)
    assert adv.tolist() == pytest.approx([0, 0.26005, 0.489, 1.02])
    assert ret.tolist() == pytest.approx([0, 0.76005, 1.089, 1.72])


def test_gae_without_values_is_the_reward_to_go():
    rewards, cu = t([9, 1, 2, 9, 3, 4]), torch.tensor([0, 3, 6])
    adv, ret = gae(rewards, None, cu, torch.tensor([False, True]))
    assert adv.tolist() == [0, 3, 2, 0, 7, 4]  # the first slot of each sequence is not an action
    assert ret.tolist() == adv.tolist()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("with_values", [True, False])
def test_gae_matches_naive_reference_on_random_batches(gamma, lam, with_values):
    for seed in range(20):
        batch = random_batch(seed)
        values = batch["values"] if with_values else None
        adv, ret = gae(batch["rewards"], values, batch["cu"], batch["no_eos"], discount=gamma, gae_lambda=lam)
        ref_adv, ref_ret = naive_gae(batch["rewards"], values, batch["cu"], batch["no_eos"], gamma, lam)
        torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_gae_on_long_sequences_matches_reference():
    rewards = torch.randn(700, dtype=F64, generator=torch.Generator().manual_seed(0))
    values = torch.randn(700, dtype=F64, generator=torch.Generator().manual_seed(1))
    cu, no_eos = torch.tensor([0, 300, 301 + 255, 700]), torch.tensor([True, False, True])
    adv, ret = gae(rewards, values, cu, no_eos, discount=0.99, gae_lambda=0.95)
    ref_adv, ref_ret = naive_gae(rewards, values, cu, no_eos, 0.99, 0.95)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)


def test_gae_rejects_mismatched_lengths():
    with pytest.raises(AlgoInputError, match=r"values must be 1-D of length T=4, got shape \(3,\)"):
        gae(t([0, 0, 0, 1]), t([0, 0, 0]), torch.tensor([0, 4]), torch.tensor([False]))
    with pytest.raises(AlgoInputError, match="seq_no_eos_mask must be 1-D with one entry per sequence"):
        gae(t([0, 0, 0, 1]), None, torch.tensor([0, 4]), torch.tensor([False, True]))
    with pytest.raises(AlgoInputError, match=r"discount \(1.5\) and gae_lambda \(1.0\) must be in \[0, 1\]"):
        gae(t([0, 0, 0, 1]), None, torch.tensor([0, 4]), torch.tensor([False]), discount=1.5)


# --- normalisation -------------------------------------------------------------------------------------


def test_masked_normalize_hand_case():
    # Valid 1, 2, 3: mean 2, population std sqrt(2/3) = 0.8165; the masked 100 is ignored and set to 0.
    out = masked_normalize(t([1, 2, 3, 100]), torch.tensor([True, True, True, False]))
    std = math.sqrt(2 / 3)
    assert out.tolist() == pytest.approx([-1 / (std + 1e-5), 0, 1 / (std + 1e-5), 0])


def test_masked_normalize_across_ranks_equals_normalizing_the_union():
    x_a, m_a = t([1.0, 5.0, -2.0]), torch.tensor([True, True, False])
    x_b, m_b = t([4.0, 0.5]), torch.tensor([True, True])
    # The other rank's [sum, sum of squares, count] over its valid tokens: 4.5, 16.25, 2.
    other = t([4.5, 16.25, 2.0])
    out_a = masked_normalize(x_a, m_a, reduce_fn=lambda moments: moments + other)
    union = naive_normalize([1.0, 5.0, -2.0, 4.0, 0.5], [True, True, False, True, True])
    assert out_a.tolist() == pytest.approx(union[:3])
    # Without an initialised process group, dist_sum leaves the local statistics alone.
    assert masked_normalize(x_b, m_b, reduce_fn=dist_sum()).tolist() == pytest.approx(
        naive_normalize([4.0, 0.5], [True, True])
    )


def test_masked_normalize_keeps_dtype_and_survives_an_empty_mask():
    out = masked_normalize(torch.ones(3), torch.zeros(3, dtype=torch.bool))
    assert out.dtype == torch.float32 and out.tolist() == [0, 0, 0]


def test_group_normalize_per_answer_is_grpos():
    """Rewards 1, -1, -1 on answers of 1, 3 and 5 tokens. GRPO (DeepSeekMath): (R - mean R) / std R per answer,
    mean -1/3, std sqrt(8/9): 1.414, -0.707, -0.707. Per token (the original's) the eight tokens of the wrong
    answers pull the mean to -7/9: 2.828, -0.354, -0.354."""
    lengths, rewards = [1, 3, 5], [1.0, -1.0, -1.0]
    x = t([r for r, n in zip(rewards, lengths, strict=True) for _ in range(n)])
    mask, cu = torch.ones(9, dtype=torch.bool), torch.tensor([0, 1, 4, 9])
    answer = group_masked_normalize(x, mask, cu, group_size=3, eps=0.0)
    assert answer[[0, 1, 4]].tolist() == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    token = group_masked_normalize(x, mask, cu, group_size=3, level="token", eps=0.0)
    assert token[[0, 1, 4]].tolist() == pytest.approx([2**1.5, -(2**0.5) / 4, -(2**0.5) / 4])
    with pytest.raises(AlgoInputError, match="level 'answers'"):
        group_masked_normalize(x, mask, cu, group_size=3, level="answers")


def test_group_normalize_per_token_matches_naive_per_group():
    for seed in range(10):
        batch = random_batch(seed, n_seqs=6)
        x, cu = batch["rewards"], batch["cu"]
        mask = response_mask(batch["prompt_mask"], cu)
        out = group_masked_normalize(x, mask, cu, group_size=3, level="token")
        expected = [0.0] * len(x)
        for group in ([0, 1, 2], [3, 4, 5]):
            idx = [i for b in group for i in range(int(cu[b]), int(cu[b + 1]))]
            for i, v in zip(
                idx, naive_normalize([float(x[i]) for i in idx], [bool(mask[i]) for i in idx]), strict=True
            ):
                expected[i] = v
        torch.testing.assert_close(out, t(expected))
        # Explicit ids (any labels, any order) give the same as consecutive groups.
        ids = torch.tensor([7, 7, 7, 2, 2, 2])
        torch.testing.assert_close(group_masked_normalize(x, mask, cu, group_ids=ids, level="token"), out)


def test_group_normalize_needs_exactly_one_grouping():
    x, mask, cu = t([0, 1, 0, 1]), torch.tensor([False, True, False, True]), torch.tensor([0, 2, 4])
    with pytest.raises(AlgoInputError, match="exactly one of group_size"):
        group_masked_normalize(x, mask, cu)
    with pytest.raises(AlgoInputError, match="group_size=3 must be positive and divide"):
        group_masked_normalize(x, mask, cu, group_size=3)


# --- the whole pipeline --------------------------------------------------------------------------------


def grpo_batch():
    # Two answers to one prompt: 1 prompt token + 2 response tokens each, scored +5 and -5.
    return dict(
        scores=t([5.0, -5.0]),
        prompt_mask=torch.tensor([True, False, False, True, False, False]),
        cu_seqlens=torch.tensor([0, 3, 6]),
        seq_no_eos_mask=torch.tensor([False, False]),
        kl_ctl=0.0,
    )


def test_compute_advantages_grpo_hand_case():
    out = compute_advantages(**grpo_batch(), group_adv_norm=True, group_size=2)
    # Raw advantages are the reward to go, +5 / -5; the group has mean 0 and std 5.
    a = 5 / (5 + 1e-5)
    assert out["advantages"].tolist() == pytest.approx([0, a, a, 0, -a, -a])
    assert out["returns"].tolist() == [0, 5, 5, 0, -5, -5]
    assert out["loss_mask"].tolist() == [False, True, True, False, True, True]


def test_compute_advantages_without_normalisation_and_with_kl():
    batch = grpo_batch() | dict(
        kl_ctl=1.0, logp_behav=t([0, -1, -1, 0, -1, -1]), logp_ref=t([0, -1, -2, 0, -1, -1])
    )
    out = compute_advantages(**batch, adv_norm=False)
    # Token 2 pays a KL penalty of -1*(-1 - -2) = -1 on top of its score 5.
    assert out["rewards"].tolist() == [0, 0, 4, 0, 0, -5]
    assert out["advantages"].tolist() == [0, 4, 4, 0, -5, -5]
