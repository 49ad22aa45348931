"""The algorithm family against hand-computed float64 values: corrections of stale samples, GSPO / CISPO /
clip-higher, loss aggregation, group baselines, DAPO's length shaping, KL estimators, the loglinear proximal
policy and distillation. Each case is small enough to check on paper."""

import math

import pytest
import torch

from areal_hpc.algo.advantages import Overlong, compute_advantages, group_baseline, overlong_penalty
from areal_hpc.algo.aggregation import Totals, aggregate, local_totals
from areal_hpc.algo.corrections import Correction, behaviour_weight, loglinear_proximal
from areal_hpc.algo.packing import AlgoInputError
from areal_hpc.algo.ppo import actor_loss, summarize
from areal_hpc.train.interfaces import EarlyStop

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def ones(n):
    return torch.ones(n, dtype=torch.bool)


def cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


# --- corrections of the behaviour policy ----------------------------------------------------------------


def test_token_mask_keeps_tokens_whose_ratio_is_in_bounds():
    # pi/mu = 2, 0.25, 8: with bounds [0.5, 5] the second and the third are masked (weight 0).
    judged = behaviour_weight(
        torch.log(t([2.0, 0.25, 8.0])), t([0.0] * 3), ones(3), cu(3), Correction(lower=0.5)
    )
    assert judged.weight.tolist() == pytest.approx([2.0, 0.0, 0.0])
    assert judged.log_raw.exp().tolist() == pytest.approx([2.0, 0.25, 8.0])
    assert judged.kept.tolist() == [True, False, False]


def test_sequence_level_uses_the_geometric_mean_of_the_answer():
    # Answer 1: ratios 2 and 8, geometric mean 4 (> 3: masked whole); answer 2: 0.5 and 2, mean 1 (kept).
    logp = torch.log(t([2.0, 8.0, 0.5, 2.0]))
    judged = behaviour_weight(logp, t([0.0] * 4), ones(4), cu(2, 2), Correction(level="sequence", upper=3.0))
    assert judged.weight.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])
    assert judged.kept.tolist() == [False, False, True, True]


def test_clamp_truncates_the_weight_and_its_bounds_hold():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(50, dtype=F64, generator=g) * 2
    for level in ("token", "sequence"):
        corr = Correction(level=level, action="clamp", lower=0.5, upper=2.0)
        judged = behaviour_weight(logp, t([0.0] * 50), ones(50), cu(20, 30), corr)
        w, raw = judged.weight, judged.log_raw.exp()
        assert bool(judged.kept.all()) and float(w.min()) >= 0.5 and float(w.max()) <= 2.0
        inside = (raw >= 0.5) & (raw <= 2.0)
        torch.testing.assert_close(w[inside], raw[inside], rtol=1e-15, atol=0)  # untouched within the bounds


@pytest.mark.parametrize(
    "metric, value",
    [("k1", -math.log(2)), ("k2", math.log(2) ** 2 / 2), ("k3", 2 - 1 - math.log(2))],
)
def test_kl_metrics_of_a_ratio_of_two(metric, value):
    # verl's direction: r = pi/mu = 2 on a token sampled from mu; k1 = -log r, k2 = (log r)^2 / 2,
    # k3 = r - 1 - log r (an estimate of KL(mu || pi), never negative).
    corr = Correction(metric=metric, upper=value - 1e-9)  # just below: masked
    judged = behaviour_weight(t([math.log(2)]), t([0.0]), ones(1), cu(1), corr)
    assert not judged.kept.any() and judged.weight.item() == 0.0
    corr = Correction(metric=metric, upper=value + 1e-9)  # just above: kept, with its ratio as weight
    judged = behaviour_weight(t([math.log(2)]), t([0.0]), ones(1), cu(1), corr)
    assert judged.weight.item() == pytest.approx(2.0)


def test_verl_rollout_correction_presets_mean_the_same_here():
    """verl's seq_mean_k3 (its K3-RS preset, 0.01) and seq_mean_k1 "0.999_1.001" (Geo-RS, bounds on the
    answer's geometric mean ratio) as {level: sequence, metric: k3, upper: 0.01} and {level: sequence, metric:
    ratio, lower: 0.999, upper: 1.001}; verl's token_k1 "0.5_1.5" as {metric: ratio, lower: 0.5, upper: 1.5}."""
    g = torch.Generator().manual_seed(1)
    seq = torch.arange(40) // 20  # two answers of 20 tokens, the second further from mu
    log_r = torch.randn(40, dtype=F64, generator=g) * torch.where(seq == 0, 0.1, 0.3)  # log(pi/mu)
    per_answer = lambda x: torch.stack([x[seq == i].mean() for i in range(2)])[seq]  # noqa: E731
    k3 = torch.exp(log_r) - 1 - log_r  # verl: exp(log r) - 1 - log r, r = pi_old / pi_rollout
    corr = Correction(level="sequence", metric="k3", upper=0.01)
    kept = behaviour_weight(log_r, t([0.0] * 40), ones(40), cu(20, 20), corr).kept
    assert torch.equal(kept, per_answer(k3) <= 0.01) and kept.any() and not kept.all()
    corr = Correction(level="sequence", lower=0.999, upper=1.001)
    kept = behaviour_weight(log_r, t([0.0] * 40), ones(40), cu(20, 20), corr).kept
    assert torch.equal(kept, (per_answer(log_r) >= math.log(0.999)) & (per_answer(log_r) <= math.log(1.001)))
    kept = behaviour_weight(log_r, t([0.0] * 40), ones(40), cu(40), Correction(lower=0.5, upper=1.5)).kept
    assert torch.equal(kept, (torch.exp(log_r) >= 0.5) & (torch.exp(log_r) <= 1.5))


# Three answers: one sampled where pi is e^200 times likelier than mu, one e^-200, one near mu.
EXTREME_LOG_RATIOS = [200.0] * 4 + [-200.0] * 4 + [0.3, -0.3, 0.05, 1.0]
EXTREME_ADV = [1.0, -1.0, 0.5, -2.0] * 3
BOUNDED = [  # every correction whose bounds hold both extremes: (level, action, metric, lower, upper)
    ("token", "mask", "ratio", None, 5.0),
    ("token", "mask", "ratio", 0.5, 2.0),
    ("sequence", "mask", "ratio", None, 5.0),
    ("token", "clamp", "ratio", None, 2.0),
    ("token", "clamp", "ratio", 0.5, 2.0),
    ("sequence", "clamp", "ratio", 0.5, 2.0),
    ("token", "mask", "k1", -1.0, 1.0),
    ("sequence", "mask", "k1", -1.0, 1.0),
    ("token", "mask", "k2", None, 1.0),
    ("token", "mask", "k3", None, 1.0),
    ("sequence", "mask", "k3", None, 0.5),
]


@pytest.mark.parametrize(
    "bounds, policy_loss, policies",
    [
        (b, loss, policies)
        for b in BOUNDED
        for loss in ("ppo", "gspo", "gspo_token", "cispo")
        for policies in (2, 3)
        if not (loss == "cispo" and policies == 2 and b[1] == "mask")  # refused (below)
    ],
)
def test_log_ratios_of_200_give_float32_what_float64_gives(bounds, policy_loss, policies):
    """The correction runs in log space: e^+-200 never overflows float32 (e^200 is inf there, e^-200 is 0, and
    the old weight/raw made 0/0), so the loss and its gradient are finite and equal float64's."""
    correction = Correction(*bounds)
    results = []
    for dtype in (F64, torch.float32):
        logp = (torch.linspace(-3.0, -0.5, 12, dtype=F64)).to(dtype).requires_grad_(True)
        proximal = (logp.detach() - 0.05) if policies == 3 else None
        target = logp.detach() if proximal is None else proximal
        behaviour = target - t(EXTREME_LOG_RATIOS, dtype)
        loss, stats = actor_loss(
            logp, behaviour, t(EXTREME_ADV, dtype), ones(12), cu_seqlens=cu(4, 4, 4), policy_loss=policy_loss,
            eps_clip=1.0 if policy_loss == "cispo" else 0.2, eps_clip_higher=0.28, proximal_logprobs=proximal,
            correction=correction, loss_agg_mode="seq-mean-token-mean",
        )  # fmt: skip
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), dtype
        results.append((loss.detach().double(), logp.grad.double(), summarize(stats)["actor_loss/avg"]))
    (loss64, grad64, avg64), (loss32, grad32, avg32) = results
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad32, grad64, rtol=1e-5, atol=1e-6)
    assert math.isfinite(avg32) and avg32 == pytest.approx(avg64, rel=1e-5, abs=1e-6)


def test_two_policy_clamp_weights_cispo_by_its_own_clipped_weight():
    # r = pi/mu = 10, truncated at C = 2: cispo's weight is clip(min(r, C), 0, 1.28) = 1.28, not 1.28 * 2/10.
    logp = t([math.log(10.0)]).requires_grad_(True)
    loss, _ = actor_loss(
        logp, t([0.0]), t([1.0]), ones(1), policy_loss="cispo", eps_clip=1.0, eps_clip_higher=0.28,
        correction=Correction(action="clamp", upper=2.0),
    )  # fmt: skip
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.28)  # -A * 1.28 * dlog(pi)


def test_cispo_refuses_masking_its_own_ratio():
    with pytest.raises(AlgoInputError, match="cispo keeps every token's gradient"):
        actor_loss(t([0.0]), t([0.0]), t([1.0]), ones(1), policy_loss="cispo", correction=Correction())


def test_a_correction_refuses_what_it_cannot_do():
    with pytest.raises(AlgoInputError, match="metric must be ratio"):
        Correction(action="clamp", metric="k3")
    with pytest.raises(AlgoInputError, match="lower 2.0 is not below upper 1.0"):
        Correction(lower=2.0, upper=1.0)


def test_two_policy_correction_masks_against_the_current_policy():
    # No proximal policy: r = pi/mu = 1.5 and 8 already weight the tokens; the cap 5 masks the second.
    logp = torch.log(t([1.5, 8.0])).requires_grad_(True)
    loss, stats = actor_loss(
        logp, t([0.0, 0.0]), t([1.0, -1.0]), ones(2), eps_clip=0.9, correction=Correction()
    )
    assert loss.item() == pytest.approx(-1.5 / 2)  # the masked token stays in the normaliser
    assert summarize(stats)["behave_masked_ratio/avg"] == 0.5
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.5 / 2, 0.0])


def test_two_policy_clamp_is_truncated_importance_sampling():
    # r = 3 with A = -1 (not PPO-clipped upwards for A < 0): the clamp at 2 makes the loss -A * 2.
    logp = t([math.log(3.0)]).requires_grad_(True)
    loss, stats = actor_loss(
        logp, t([0.0]), t([-1.0]), ones(1), correction=Correction(action="clamp", upper=2.0)
    )
    assert loss.item() == pytest.approx(2.0) and summarize(stats)["behave_clamped_ratio/avg"] == 1.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0)  # -A * min(r, 2) * dlog(pi)


# --- policy losses ----------------------------------------------------------------------------------------


def test_clip_higher_is_asymmetric():
    # r = 1.25 with A = 1: inside [0.8, 1.28] (eps_clip_higher 0.28), clipped at 1.2 with the symmetric clip.
    logp = t([math.log(1.25)])
    sym, _ = actor_loss(logp, t([0.0]), t([1.0]), ones(1), eps_clip=0.2)
    high, stats = actor_loss(logp, t([0.0]), t([1.0]), ones(1), eps_clip=0.2, eps_clip_higher=0.28)
    assert sym.item() == pytest.approx(-1.2) and high.item() == pytest.approx(-1.25)
    low, stats = actor_loss(
        t([math.log(0.7)]), t([0.0]), t([-1.0]), ones(1), eps_clip=0.2, eps_clip_higher=0.28
    )
    assert low.item() == pytest.approx(0.8) and summarize(stats)["clip_ratio_low/avg"] == 1.0


def test_gspo_clips_the_sequence_ratio():
    # Answer 1: ratios 2 and 0.5, geometric mean 1: unclipped, loss -A; answer 2: ratios 1.5, 1.5: s = 1.5,
    # clipped at 1.0004 for A = 1. Sequence-mean aggregation: the mean over the two answers.
    logp = torch.log(t([2.0, 0.5, 1.5, 1.5])).requires_grad_(True)
    loss, stats = actor_loss(
        logp, t([0.0] * 4), t([1.0] * 4), ones(4), cu_seqlens=cu(2, 2), policy_loss="gspo",
        eps_clip=3e-4, eps_clip_higher=4e-4, loss_agg_mode="seq-mean-token-mean",
    )  # fmt: skip
    assert loss.item() == pytest.approx((-1.0 - 1.0004) / 2)
    assert summarize(stats)["importance_weight/max"] == pytest.approx(1.5)
    loss.backward()
    # d(-s)/dlogp_t = -s / |y| on answer 1 (s = 1, 2 tokens), / 2 answers; answer 2 is clipped: 0.
    assert logp.grad.tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0])


def test_gspo_with_one_token_answers_is_ppo():
    g = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(6, dtype=F64, generator=g) * 0.3 for _ in range(3))
    kw = dict(cu_seqlens=cu(*[1] * 6), eps_clip=0.2, c_clip=3.0, loss_agg_mode="seq-mean-token-mean")
    grads = []
    for kind in ("ppo", "gspo", "gspo_token"):
        x = logp.clone().requires_grad_(True)
        loss, _ = actor_loss(x, old, adv, ones(6), policy_loss=kind, **kw)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    for loss, grad in grads[1:]:
        torch.testing.assert_close(loss, grads[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, grads[0][1], rtol=1e-12, atol=1e-12)


def test_gspo_token_gives_each_token_its_own_advantage():
    # s = 1 (ratios 2 and 0.5); per-token advantages 1 and -1: gradient -A_t * s / 2 tokens / 1 answer.
    logp = torch.log(t([2.0, 0.5])).requires_grad_(True)
    loss, _ = actor_loss(
        logp,
        t([0.0, 0.0]),
        t([1.0, -1.0]),
        ones(2),
        policy_loss="gspo_token",
        loss_agg_mode="seq-mean-token-mean",
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.0) and logp.grad.tolist() == pytest.approx([-0.5, 0.5])


def test_cispo_is_reinforce_weighted_by_the_clipped_ratio():
    # r = 3 (clipped to 1.28) and 0.5 (no lower clip with eps_clip 1): gradient -sg(clip(r)) * A.
    logp = torch.log(t([3.0, 0.5])).requires_grad_(True)
    loss, stats = actor_loss(
        logp, t([0.0, 0.0]), t([1.0, 2.0]), ones(2), policy_loss="cispo", eps_clip=1.0, eps_clip_higher=0.28
    )
    assert loss.item() == pytest.approx(-(1.28 * math.log(3.0) + 0.5 * 2 * math.log(0.5)) / 2)
    assert summarize(stats)["clip_ratio_high/avg"] == 0.5 and summarize(stats)["clip_ratio_low/avg"] == 0.0
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.28 / 2, -1.0 / 2])


def test_kl_in_the_loss_pulls_towards_the_reference():
    # k3 of pi vs ref with pi/ref = 2: rho = 1/2, k3 = 0.5 - 1 + log 2; d k3 / d log pi = 1 - rho = 0.5.
    logp = t([math.log(2.0)]).requires_grad_(True)
    loss, stats = actor_loss(
        logp, logp.detach(), t([0.0]), ones(1), ref_logprobs=t([0.0]), kl_coef=0.1, kl_estimator="k3"
    )
    assert loss.item() == pytest.approx(0.1 * (math.log(2) - 0.5))
    assert summarize(stats)["kl_loss/avg"] == pytest.approx(math.log(2) - 0.5)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.1 * 0.5)


# --- aggregation ------------------------------------------------------------------------------------------

# Two answers: 3 valid tokens with losses 1, 2, 3, and 1 valid token with loss 4 (its second token masked).
LOSSES, MASK, CU = t([1.0, 2.0, 3.0, 4.0, 9.0]), torch.tensor([True, True, True, True, False]), cu(3, 2)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10 / 4),
        ("token-sum", 10.0),
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (8 * 2)),
    ],
)
def test_each_aggregation_mode_by_hand(mode, expected):
    assert aggregate(LOSSES, MASK, CU, mode, norm_len=8).item() == pytest.approx(expected)


def test_an_all_masked_answer_counts_in_no_normaliser():
    mask = torch.tensor([True, True, True, False, False])  # the second answer has no valid token
    assert local_totals(mask, CU).tolist() == [3.0, 1.0]
    assert aggregate(LOSSES, mask, CU, "seq-mean-token-mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo_token", "cispo"])
def test_a_minibatch_cut_differently_gives_the_same_gradient(mode, policy_loss):
    """Micro-batches and data-parallel ranks are parts of the minibatch: with its global totals the summed
    gradient is the same however it is cut (the normaliser of every mode is the minibatch's)."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 5, 1, 4, 2, 6]
    n = sum(lengths)
    logp, old, adv = (torch.randn(n, dtype=F64, generator=g) * 0.3 for _ in range(3))
    mask = torch.rand(n, generator=g) < 0.8
    bounds = cu(*lengths).tolist()
    totals = Totals(*local_totals(mask, cu(*lengths)).tolist())

    def gradient(cuts):  # cuts: groups of whole sequences, each one part (a micro-batch or a rank's share)
        x = logp.clone().requires_grad_(True)
        for seqs in cuts:
            idx = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in seqs])
            loss, _ = actor_loss(
                x[idx], old[idx], adv[idx], mask[idx], cu_seqlens=cu(*[lengths[i] for i in seqs]),
                policy_loss=policy_loss, loss_agg_mode=mode, totals=totals, norm_len=8,
            )  # fmt: skip
            loss.backward()
        return x.grad

    whole = gradient([[0, 1, 2, 3, 4, 5]])
    torch.testing.assert_close(gradient([[0, 1], [2, 3, 4], [5]]), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gradient([[5, 0], [3], [1, 4, 2]]), whole, rtol=1e-12, atol=1e-14)


def test_early_stop_judges_the_whole_minibatch_however_it_is_cut():
    """ppo.early_stop_imp_ratio: ratios 6, 6, 1, 1, 1, 1 have the minibatch mean 16/6, below 5, though a
    micro-batch of the first two alone has mean 6. Every cut keeps the step under 5 and skips it under 2."""
    logp, n = torch.log(t([6.0, 6.0, 1.0, 1.0, 1.0, 1.0])), 6
    for cuts in ([[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3, 4, 5]], [[5, 0], [3], [1, 4, 2]]):
        verdicts = []
        for bound in (5.0, 2.0):
            stop = EarlyStop(bound)
            for seqs in cuts:
                idx = torch.tensor(seqs)
                _, stats = actor_loss(logp[idx], t([0.0] * len(seqs)), t([1.0] * len(seqs)), ones(len(seqs)),
                                      cu_seqlens=cu(*[1] * len(seqs)), totals=Totals(n, n))  # fmt: skip
                stop.add(stats)
            verdicts.append(stop())
        assert verdicts == [False, True], cuts


# --- advantages: baselines, length shaping, distillation --------------------------------------------------


def test_group_baselines_by_hand():
    scores, groups = t([1.0, 0.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 0, 1])
    assert group_baseline(scores, groups, "mean").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])
    # RLOO: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3. An answer alone in its group: 0.
    loo = group_baseline(scores, groups, "leave_one_out")
    assert loo.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


def test_a_zero_variance_group_gets_zero_advantages():
    # Two answers with the same reward: every baseline and the group normalisation give 0, not NaN.
    kw = dict(
        scores=t([1.0, 1.0]), prompt_mask=torch.tensor([True, False, False, True, False, False]),
        cu_seqlens=cu(3, 3), seq_no_eos_mask=torch.tensor([False, False]), kl_ctl=0.0, group_size=2,
    )  # fmt: skip
    for baseline, group_norm in (("mean", False), ("leave_one_out", False), ("none", True)):
        adv = compute_advantages(**kw, baseline=baseline, adv_norm=group_norm, group_adv_norm=group_norm)
        assert adv["advantages"].tolist() == [0.0] * 6


def test_overlong_penalty_by_hand():
    # max 20 tokens, buffer 4: no penalty up to 16, then -(len - 16) / 4, -1 from 20 on (times the factor).
    lens = torch.tensor([10, 16, 17, 19, 20, 25])
    assert overlong_penalty(lens, 20, 4).tolist() == pytest.approx([0, 0, -0.25, -0.75, -1, -1])
    assert overlong_penalty(lens, 20, 4, factor=0.5).tolist()[2] == pytest.approx(-0.125)


def test_overlong_shaping_and_filtering_in_the_pipeline():
    # Two one-prompt-token answers of 2 and 4 tokens, max 4 with a buffer of 2: the second loses 1; it is also
    # truncated, and overlong filtering leaves it out of the loss mask.
    prompt = torch.tensor([True, False, False, True, False, False, False, False])
    out = compute_advantages(
        scores=t([1.0, 1.0]), prompt_mask=prompt, cu_seqlens=cu(3, 5), seq_no_eos_mask=torch.tensor([False, True]),
        kl_ctl=0.0, adv_norm=False, overlong=Overlong(4, 2), overlong_filter=True,
    )  # fmt: skip
    assert out["rewards"].tolist() == pytest.approx([0, 0, 1.0, 0, 0, 0, 0, 0.0])
    assert out["loss_mask"].tolist() == [False, True, True, False, False, False, False, False]


@pytest.mark.parametrize("alone", [True, False])
def test_distillation_advantage_is_the_reverse_kl_per_token(alone):
    # Teacher logprobs -1, -2; the policy's -1.5, -1.5: advantages 0.5 * (0.5, -0.5) (plus the task's 1).
    out = compute_advantages(
        scores=t([1.0]), prompt_mask=torch.tensor([True, False, False]), cu_seqlens=cu(3),
        seq_no_eos_mask=torch.tensor([False]), kl_ctl=0.0, adv_norm=False,
        logp_behav=t([0.0, -1.5, -1.5]), logp_teacher=t([0.0, -1.0, -2.0]), distill_coef=0.5, distill_alone=alone,
    )  # fmt: skip
    task = 0.0 if alone else 1.0
    assert out["advantages"].tolist() == pytest.approx([0.0, task + 0.25, task - 0.25])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_reward_uses_the_estimator(estimator):
    out = compute_advantages(
        scores=t([0.0]), prompt_mask=torch.tensor([True, False]), cu_seqlens=cu(2),
        seq_no_eos_mask=torch.tensor([False]), logp_behav=t([0.0, math.log(2)]), logp_ref=t([0.0, 0.0]),
        kl_ctl=0.1, kl_estimator=estimator, adv_norm=False,
    )  # fmt: skip
    expected = {"k1": math.log(2), "k2": math.log(2) ** 2 / 2, "k3": 0.5 - 1 + math.log(2)}[estimator]
    assert out["kl_rewards"].tolist() == pytest.approx([0.0, -0.1 * expected])


# --- the loglinear proximal policy -------------------------------------------------------------------------


def test_loglinear_proximal_by_hand():
    # Proximal version 5, current taken as 6. A token of version 5 keeps mu (a = 0); version 4: a = 1/2;
    # version 2: a = 3/4; not sampled (-1): mu.
    behav, logp = t([-1.0, -1.0, -1.0, -1.0]), t([-3.0, -3.0, -3.0, -3.0])
    prox = loglinear_proximal(behav, logp, torch.tensor([5, 4, 2, -1]), version=5)
    assert prox.tolist() == pytest.approx([-1.0, -2.0, -2.5, -1.0])
