"""PPO actor/critic losses: hand-computed cases, gradients, and a naive per-token float64 reference."""

import math

import pytest
import torch

from areal_hpc.algo.aggregation import Totals
from areal_hpc.algo.corrections import Correction
from areal_hpc.algo.packing import AlgoInputError
from areal_hpc.algo.ppo import actor_loss, critic_loss, masked_summary, summarize

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def leaf(values):
    return t(values).requires_grad_(True)


# --- a hand case: five tokens, the first masked -------------------------------------------------------
# token  A     r     -A*r   -A*clip(r, 0.8, 1.2)  PPO loss   with c_clip=3
#   0    masked (its logprob is garbage: 100)
#   1    1     1.5   -1.5   -1.2                  -1.2 (clipped)
#   2   -2     0.5    1.0    1.6                   1.6 (clipped)
#   3    0.5   1.0   -0.5   -0.5                  -0.5
#   4   -1     5.0    5.0    1.2                   5.0        3.0 (dual clipped: -A*3)
RATIOS = [1.0, 1.5, 0.5, 1.0, 5.0]
ADV = [7.0, 1.0, -2.0, 0.5, -1.0]
MASK = torch.tensor([False, True, True, True, True])


def hand_logprobs():
    logp = [math.log(r) for r in RATIOS]
    logp[0] = 100.0
    return leaf(logp)


def test_actor_loss_hand_case():
    logp = hand_logprobs()
    loss, stats = actor_loss(logp, t([0.0] * 5), t(ADV), MASK, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 0.5 + 5.0) / 4)
    summary = summarize(stats)
    assert summary["importance_weight/avg"] == pytest.approx((1.5 + 0.5 + 1.0 + 5.0) / 4)
    assert summary["importance_weight/max"] == pytest.approx(5.0)
    assert summary["clip_ratio/avg"] == 0.5
    assert summary["dual_clip_ratio/avg"] == 0.0
    assert summary["approx_kl/min"] == pytest.approx(-math.log(5.0))
    assert summary["n_valid_tokens"] == 4 and summary["n_tokens"] == 5 and summary["clipped_tokens"] == 2
    # Gradient of sum(-A*r)/4 w.r.t. logp is -A*r/4 on unclipped tokens, 0 on clipped and masked ones.
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0, 0, 0, -0.5 / 4, 5.0 / 4])


def test_dual_clip_caps_negative_advantage_tokens():
    logp = hand_logprobs()
    loss, stats = actor_loss(logp, t([0.0] * 5), t(ADV), MASK, eps_clip=0.2, c_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 0.5 + 3.0) / 4)
    assert summarize(stats)["dual_clip_ratio/avg"] == 0.25
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0, 0, 0, -0.5 / 4, 0])


def test_decoupled_loss_hand_case():
    # r = pi_theta / pi_prox = 1.1, 1, 1; behaviour weights w = pi_prox / pi_behav = 2, 0.5, 8 (> cap 5: 0).
    logp = leaf([math.log(1.1), 0.0, 0.0])
    prox = t([0.0, 0.0, 0.0])
    behav = -torch.log(t([2.0, 0.5, 8.0]))
    loss, stats = actor_loss(
        logp,
        behav,
        t([1.0, 1.0, -1.0]),
        torch.ones(3, dtype=torch.bool),
        proximal_logprobs=prox,
        correction=Correction(),  # the default: what behav_imp_weight_cap 5 was
    )
    # PPO terms -1.1, -1, 1 times weights 2, 0.5, 0; the capped token still counts in the normaliser.
    assert loss.item() == pytest.approx((-2.2 - 0.5 + 0.0) / 3)
    summary = summarize(stats)
    assert summary["behave_imp_weight/avg"] == pytest.approx(1.25)  # over the 2 unclipped tokens only
    assert summary["behave_approx_kl/max"] == pytest.approx(math.log(2.0))
    assert summary["unclipped_behave_tokens"] == 2
    assert summary["importance_weight/avg"] == pytest.approx(3.1 / 3)  # measured against pi_prox
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.1 * 2 / 3, -1 * 0.5 / 3, 0.0])


# --- a naive per-token reference on random inputs ------------------------------------------------------


def naive_actor_loss(logp, old, adv, mask, eps, c_clip, prox, cap, normalizer):
    """One token at a time with scalar torch ops, so autograd gives the reference gradient too."""
    total = torch.zeros((), dtype=F64)
    for i in range(len(mask)):
        if not mask[i]:
            continue
        base = old[i] if prox is None else prox[i]
        r = torch.exp(logp[i] - base)
        a = float(adv[i])
        term = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
        if c_clip is not None and a < 0:
            term = torch.minimum(term, t(-a * c_clip))
        if prox is not None:
            w = math.exp(float(prox[i] - old[i]))
            term = term * (0.0 if cap is not None and w > cap else w)
        total = total + term
    return total / normalizer


def random_inputs(seed, n=40):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, dtype=F64, generator=g) * 3
    return {
        "logp": old + 0.4 * torch.randn(n, dtype=F64, generator=g),
        "old": old,
        "prox": old + 0.8 * torch.randn(n, dtype=F64, generator=g),
        "adv": torch.randn(n, dtype=F64, generator=g),
        "mask": torch.rand(n, generator=g) < 0.7,
    }


@pytest.mark.parametrize("c_clip", [None, 1.5])
@pytest.mark.parametrize("decoupled, cap", [(False, None), (True, None), (True, 2.0)])
def test_actor_loss_matches_naive_reference(c_clip, decoupled, cap):
    for seed in range(5):
        x = random_inputs(seed)
        prox = x["prox"] if decoupled else None
        normalizer = 100.0
        logp = x["logp"].clone().requires_grad_(True)
        loss, _ = actor_loss(
            logp,
            x["old"],
            x["adv"],
            x["mask"],
            eps_clip=0.2,
            c_clip=c_clip,
            proximal_logprobs=prox,
            correction=Correction(upper=cap) if decoupled else None,
            totals=Totals(tokens=normalizer, seqs=1),
        )
        loss.backward()
        ref_logp = x["logp"].clone().requires_grad_(True)
        ref = naive_actor_loss(ref_logp, x["old"], x["adv"], x["mask"], 0.2, c_clip, prox, cap, normalizer)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-12, atol=1e-12)


def test_micro_batch_losses_add_up_to_the_minibatch_mean():
    x = random_inputs(7, n=30)
    full, _ = actor_loss(x["logp"], x["old"], x["adv"], x["mask"], proximal_logprobs=x["prox"])
    n_valid = int(x["mask"].sum())
    parts = [slice(0, 12), slice(12, 30)]
    summed = sum(
        actor_loss(
            x["logp"][s],
            x["old"][s],
            x["adv"][s],
            x["mask"][s],
            proximal_logprobs=x["prox"][s],
            totals=Totals(tokens=n_valid, seqs=1),
        )[0]
        for s in parts
    )
    torch.testing.assert_close(summed, full)


def test_actor_loss_rejects_bad_input():
    logp, old, adv = t([0.0, 0.0]), t([0.0, 0.0]), t([1.0, 1.0])
    mask = torch.ones(2, dtype=torch.bool)
    with pytest.raises(AlgoInputError, match=r"advantages has shape \(3,\), expected \(2,\)"):
        actor_loss(logp, old, t([1.0, 1.0, 1.0]), mask)
    with pytest.raises(AlgoInputError, match=r"c_clip \(dual clip\) must be > 1 .* got 0.5"):
        actor_loss(logp, old, adv, mask, c_clip=0.5)
    with pytest.raises(AlgoInputError, match="kl_coef=0.1 .* needs ref_logprobs"):
        actor_loss(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(AlgoInputError, match="eps_clip must be in"):
        actor_loss(logp, old, adv, mask, eps_clip=1.5)
    with pytest.raises(AlgoInputError, match="unknown policy_loss 'ppo2'"):
        actor_loss(logp, old, adv, mask, policy_loss="ppo2")


# --- critic -------------------------------------------------------------------------------------------


def test_critic_loss_hand_case():
    # token  v    v_old  R    clip(v, v_old+-0.2)  (v-R)^2  (clip-R)^2  0.5*max
    #   0    1.0  1.0    1.5  1.0                  0.25     0.25        0.125
    #   1    2.0  1.5    3.0  1.7                  1.0      1.69        0.845 (clipped)
    #   2    0.0  0.5    0.4  0.3                  0.16     0.01        0.08
    values = leaf([1.0, 2.0, 0.0, 9.0])
    mask = torch.tensor([True, True, True, False])
    loss, stats = critic_loss(
        values, t([1.0, 1.5, 0.5, 0.0]), t([1.5, 3.0, 0.4, 0.0]), mask, value_eps_clip=0.2
    )
    assert loss.item() == pytest.approx((0.125 + 0.845 + 0.08) / 3)
    assert summarize(stats)["value_clip_ratio/avg"] == pytest.approx(1 / 3)
    # d/dv of 0.5*(v-R)^2 / 3 is (v-R)/3; the clipped token's value has no gradient.
    loss.backward()
    assert values.grad.tolist() == pytest.approx([-0.5 / 3, 0.0, -0.4 / 3, 0.0])


def test_critic_loss_matches_naive_reference():
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(50, dtype=F64, generator=g) for _ in range(3))
    mask = torch.rand(50, generator=g) < 0.6
    loss, _ = critic_loss(v, old, ret, mask, value_eps_clip=0.2, loss_normalizer=64)
    expected = 0.0
    for i in range(50):
        if mask[i]:
            vi, oi, ri = float(v[i]), float(old[i]), float(ret[i])
            clipped = min(max(vi, oi - 0.2), oi + 0.2)
            expected += 0.5 * max((vi - ri) ** 2, (clipped - ri) ** 2)
    assert loss.item() == pytest.approx(expected / 64, rel=1e-12)


# --- statistics ----------------------------------------------------------------------------------------


def test_summarize_turns_masked_tensors_into_avg_min_max():
    stats = {
        "advantages": (t([1.0, -9.0, 3.0]), torch.tensor([True, False, True])),
        "n_seqs": torch.tensor(2),
    }
    assert summarize(stats, scope="ppo_actor") == {
        "ppo_actor/advantages/avg": 2.0,
        "ppo_actor/advantages/min": 1.0,
        "ppo_actor/advantages/max": 3.0,
        "ppo_actor/n_seqs": 2.0,
    }
    assert masked_summary("empty", t([1.0]), torch.tensor([False])) == {}
