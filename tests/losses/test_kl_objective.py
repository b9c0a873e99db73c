"""KL estimators, entropy, and the assembled objective (KL outside the advantage scale)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages, losses


def test_kl_hand_values():
    # logp = 0, ref = ln 2: d = ref - logp = ln 2 = 0.693147
    # k1 = logp - ref = -0.693147; k2 = ½·0.693147² = 0.240227; k3 = e^d - d - 1 = 0.306853
    logp = torch.zeros(1, 1, dtype=torch.float64)
    ref = torch.full((1, 1), math.log(2.0), dtype=torch.float64)
    ln2 = math.log(2.0)
    assert float(losses.kl("k1", logp, ref)) == pytest.approx(-ln2, abs=1e-12)
    assert float(losses.kl("k2", logp, ref)) == pytest.approx(0.5 * ln2**2, abs=1e-12)
    assert float(losses.kl("k3", logp, ref)) == pytest.approx(1 - ln2, abs=1e-12)


def test_k3_is_clamped_like_verl():
    # ref - logp = 15: e^15 - 16 ≫ 10 -> 10; ref - logp = -30: e^-20 + 20 - 1 (d clamped to -20)
    # -> 19.000000002 -> clamped to 10
    logp = torch.tensor([[0.0, 30.0, 0.0]])
    ref = torch.tensor([[15.0, 0.0, 0.5]])
    out = losses.kl("k3", logp, ref)
    assert out[0, 0] == 10.0 and out[0, 1] == 10.0
    assert float(out[0, 2]) == pytest.approx(math.exp(0.5) - 1.5, abs=1e-6)
    assert (losses.kl("k3", torch.randn(50, 7), torch.randn(50, 7)) >= 0).all()


def test_kl_bad_input():
    with pytest.raises(
        ValueError, match=r"valid names: k1, k2, k3, abs, kl, mse, low_var_kl, k1\+"
    ):
        losses.kl("k9", torch.zeros(1, 1), torch.zeros(1, 1))
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k3\+\+'"):
        losses.kl("k3++", torch.zeros(1, 1), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="ref_logp must have the shape"):
        losses.kl("k3", torch.zeros(2, 3), torch.zeros(2, 2))


def test_token_entropy_uniform_and_one_hot():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1, 0] = 1e4  # ~one-hot
    h = losses.token_entropy(logits)
    assert float(h[0, 0]) == pytest.approx(math.log(4), abs=1e-6)
    assert float(h[0, 1]) == pytest.approx(0.0, abs=1e-6)


def _inputs(seed=0, n=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64) - 0.1).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


def test_objective_equals_sum_of_pieces():
    logp, old, ref, adv, mask = _inputs()
    ent = torch.rand_like(old)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 3.0], dtype=torch.float64)
    out = losses.objective(
        logp,
        old,
        adv,
        mask,
        surrogate="ppo_clip",
        surrogate_params={"eps_high": 0.28},
        aggregation="seq_mean_token_mean",
        ref_logp=ref,
        kl="k3",
        beta=0.04,
        kl_weight=w,
        entropy=ent,
        entropy_coeff=0.01,
    )
    pt, _ = losses.surrogate("ppo_clip", logp, old, adv, mask, eps_high=0.28)
    pg = losses.aggregate("seq_mean_token_mean", pt, mask)
    kl_t = 0.04 * w[:, None] * losses.kl("k3", logp, ref) * mask
    kl = losses.aggregate("seq_mean_token_mean", kl_t, mask)
    eb = 0.01 * losses.aggregate("seq_mean_token_mean", ent * mask, mask)
    torch.testing.assert_close(out.loss, pg + kl - eb, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.pg_loss, pg, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.kl_loss, kl, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        losses.aggregate("seq_mean_token_mean", out.per_token, mask), out.loss, atol=1e-12, rtol=0
    )
    assert out.stats["kept_frac"] == 1.0 and out.stats["kl_mean"] > 0


def test_kl_gradient_does_not_change_with_the_advantage_scale():
    # Dividing the advantage by a scale s (GRPO's σ, MaxNorm's s_q) rescales the reward branch
    # only; the KL branch's gradient is the same for every s.
    logp, old, ref, adv, mask = _inputs(1)
    grads = []
    for scale in (1.0, 1e-3, 50.0):
        lp = logp.detach().clone().requires_grad_()
        out = losses.objective(lp, old, adv / scale, mask, ref_logp=ref, beta=0.1, kl="k3")
        (g_kl,) = torch.autograd.grad(out.kl_loss, lp, retain_graph=True)
        (g_all,) = torch.autograd.grad(out.loss, lp, retain_graph=True)
        (g_pg,) = torch.autograd.grad(out.pg_loss, lp)
        torch.testing.assert_close(g_all - g_pg, g_kl, atol=1e-12, rtol=0)
        grads.append((g_kl, g_pg))
    for g_kl, _ in grads[1:]:
        torch.testing.assert_close(g_kl, grads[0][0], atol=0, rtol=0)
    # while the reward branch does scale (ρ ≈ 1, so no clip is hit at these small ratios)
    assert not torch.allclose(grads[1][1], grads[0][1])


def test_kl_weight_scales_only_its_group():
    logp, old, ref, adv, mask = _inputs(2)
    base = losses.objective(logp, old, adv, mask, ref_logp=ref, beta=0.1, kl="k2")
    (g1,) = torch.autograd.grad(base.kl_loss, logp)
    w = torch.ones(6, dtype=torch.float64)
    w[2] = 4.0
    out = losses.objective(logp, old, adv, mask, ref_logp=ref, beta=0.1, kl="k2", kl_weight=w)
    (g2,) = torch.autograd.grad(out.kl_loss, logp)
    torch.testing.assert_close(g2[2], 4 * g1[2], atol=1e-12, rtol=0)
    torch.testing.assert_close(g2[[0, 1, 3, 4, 5]], g1[[0, 1, 3, 4, 5]], atol=0, rtol=0)


def test_keep_false_rows_take_part_in_neither_branch():
    logp, old, ref, adv, mask = _inputs(3)
    keep = torch.tensor([True, True, False, True, False, True])
    out = losses.objective(
        logp, old, adv, mask, ref_logp=ref, beta=0.1, keep=keep, aggregation="token_mean"
    )
    out.loss.backward()
    assert (logp.grad[~keep] == 0).all()
    # equals the objective of the kept rows alone
    lp2 = logp.detach()[keep].clone().requires_grad_()
    ref_out = losses.objective(lp2, old[keep], adv[keep], mask[keep], ref_logp=ref[keep], beta=0.1)
    ref_out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(logp.grad[keep], lp2.grad, atol=1e-12, rtol=0)
    assert out.stats["kept_frac"] == pytest.approx(4 / 6)


def test_all_dropped_micro_batch_gives_connected_zero():
    logp, old, _ref, adv, mask = _inputs(4)
    out = losses.objective(logp, old, adv, mask, keep=torch.zeros(6, dtype=torch.bool))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and (logp.grad == 0).all()


def test_maxnorm_weights_carry_no_gradient():
    # MaxNorm's weight c = u / s_q with s_q = max|u| is a constant in the loss: no gradient
    # flows into the rewards (or through s_q), and d loss / d logp = -c / #tokens exactly.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.5], [0.2, 0.9, 0.4, 0.4]], requires_grad=True)
    out = advantages.compute("maxnorm_rloo", rewards)
    c = out.values.reshape(-1)
    logp = torch.zeros(8, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(8, 3)
    pt, _ = losses.surrogate("reinforce", logp, None, c, mask)
    loss = losses.aggregate("token_mean", pt, mask)
    loss.backward()
    assert rewards.grad is None
    expect = (-c.detach().double() / 24.0)[:, None].expand(8, 3)
    torch.testing.assert_close(logp.grad, expect, atol=1e-12, rtol=0)
    assert float(c.detach().abs().max()) == pytest.approx(1.0)


def test_objective_bad_input():
    logp, old, ref, adv, mask = _inputs(5)
    with pytest.raises(ValueError, match="needs ref_logp"):
        losses.objective(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"kl_weight must be \[N\]"):
        losses.objective(logp, old, adv, mask, beta=0.1, ref_logp=ref, kl_weight=torch.ones(2))
    with pytest.raises(ValueError, match=r"keep must be \[N\]"):
        losses.objective(logp, old, adv, mask, keep=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="beta and entropy_coeff"):
        losses.objective(logp, old, adv, mask, beta=-1.0)
    with pytest.raises(ValueError, match="no valid token"):
        losses.objective(logp, old, adv, torch.zeros_like(mask))


@pytest.mark.parametrize("aggregation", sorted(losses.EXACT_UNDER_ACCUMULATION))
@pytest.mark.parametrize("parts", [2, 4])
def test_objective_micro_batches_equal_one_batch(aggregation, parts):
    # the trainer's path: keep, KL with kl_weight and the entropy bonus, split into micro-
    # batches that share the step's StepTotals -> same loss and gradient as one batch
    # (with 4 parts the second micro-batch has only keep=False rows and adds exactly 0)
    g = torch.Generator().manual_seed(7)
    n, t = 8, 6
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ent = torch.rand(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    keep = torch.tensor([True, True, False, False, True, True, False, True])
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    kw = dict(
        surrogate="ppo_clip",
        surrogate_params={"eps_high": 0.28, "clip_ratio_c": 3.0},
        aggregation=aggregation,
        kl="k3",
        beta=0.05,
        entropy_coeff=0.01,
    )
    full = losses.objective(
        logp,
        old,
        adv,
        mask,
        keep=keep,
        ref_logp=ref,
        kl_weight=w,
        entropy=ent,
        totals=losses.step_totals(mask, keep=keep),
        **kw,
    )
    (g_full,) = torch.autograd.grad(full.loss, logp)
    size = n // parts
    chunks = [slice(i * size, (i + 1) * size) for i in range(parts)]
    totals = losses.step_totals([mask[s] for s in chunks], keep=[keep[s] for s in chunks])
    acc, grad = 0.0, torch.zeros_like(logp)
    for s in chunks:
        lp = logp.detach()[s].clone().requires_grad_()
        out = losses.objective(
            lp,
            old[s],
            adv[s],
            mask[s],
            keep=keep[s],
            ref_logp=ref[s],
            kl_weight=w[s],
            entropy=ent[s],
            totals=totals,
            **kw,
        )
        out.loss.backward()
        acc += float(out.loss.detach())
        grad[s] = lp.grad
    assert acc == pytest.approx(float(full.loss.detach()), abs=1e-12)
    torch.testing.assert_close(grad, g_full, atol=1e-12, rtol=0)


def test_unweighted_kl_branch_leaves_out_beta_and_kl_weight():
    # two sequences of one token each, k1 = logp - ref: (0.5 - 0) and (0.2 - 0.4) = -0.2;
    # token_mean over the 2 kept tokens: unweighted (0.5 - 0.2)/2 = 0.15;
    # weighted by kl_weight (1, 3) and beta 0.1: 0.1 * (0.5 - 0.6)/2 = -0.005
    logp = torch.tensor([[0.5], [0.2]], requires_grad=True)
    ref = torch.tensor([[0.0], [0.4]])
    mask = torch.ones(2, 1)
    out = losses.objective(
        logp, logp.detach(), torch.zeros(2), mask, surrogate="reinforce",
        aggregation="token_mean", ref_logp=ref, kl="k1", beta=0.1,
        kl_weight=torch.tensor([1.0, 3.0]),
    )  # fmt: skip
    assert out.kl_unweighted.detach().item() == pytest.approx(0.15, abs=1e-7)
    assert out.kl_loss.detach().item() == pytest.approx(-0.005, abs=1e-7)
    (g,) = torch.autograd.grad(out.kl_unweighted, logp)
    torch.testing.assert_close(g, torch.tensor([[0.5], [0.5]]))  # d/dlogp of (k1_0 + k1_1)/2
    none = losses.objective(logp, logp.detach(), torch.zeros(2), mask, surrogate="reinforce")
    assert none.kl_unweighted.detach().item() == 0.0
