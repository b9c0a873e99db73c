"""TOPR (Tapered Off-Policy REINFORCE): hand answers, the paper's properties, verl parity.

The verl reference is verl pull request 6986's ``compute_policy_loss_topr``, which verl 0.9.1
does not contain and whose head was not available to fetch here. :func:`pr_reference` is
re-implemented from the PR's own CPU tests of that function (its ``_reference_reinforce_loss``
helper: the seq-mean-token-mean of ``−A·logp·w`` with ``count + 1e-8``; its
``test_taper_weight_is_stop_gradient``: ``w = where(mean_t A ≥ 0, 1, clamp(exp(mean_t log ρ),
0, 1))`` without gradient) and its docs/algo/topr.md (bounds
``topr_negative_ratio_lower`` / ``_upper``, default 0 / 1).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grouprl import losses

F64 = torch.float64


def pr_reference(old, logp, adv, mask, lower=0.0, upper=1.0):
    """verl PR 6986's TOPR loss (re-implemented, see the module docstring): a scalar."""
    with torch.no_grad():
        seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
        seq_adv = (adv * mask).sum(-1) / mask.sum(-1)
        w = torch.where(seq_adv >= 0, torch.ones_like(seq_ratio), seq_ratio.clamp(lower, upper))
    per_token = -adv * logp * w[:, None]
    counts = mask.sum(-1)
    seq_means = (per_token * mask).sum(-1) / (counts + 1e-8)
    valid = (counts > 0).to(logp.dtype)
    return (seq_means * valid).sum() / valid.sum()


def batch(seed, n=8, t=6, ragged=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, t, dtype=F64)
    if ragged:
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    old = -torch.rand(n, t, generator=g, dtype=F64) - 0.3
    shift = torch.randn(n, 1, generator=g, dtype=F64)  # strongly off-policy rows
    logp = (old + shift + 0.1 * torch.randn(n, t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=F64)
    return old, logp, adv, mask


def ours(old, logp, adv, mask, **params):
    per_token, stats = losses.surrogate("topr", logp, old, adv, mask, **params)
    return losses.aggregate("seq_mean_token_mean", per_token, mask), stats


# --------------------------------------------------------------------------- hand answers
def test_hand_negative_sequence_is_weighted_by_its_tapered_ratio():
    # one sequence, A = −1, two tokens with log ρ = −1 each: ρ_seq = e^−1, w = e^−1;
    # ℓ = mean_t(−A·w·logp_t), ∂ℓ/∂logp_t = −A·w/2 = e^−1/2
    old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    logp = (old - 1.0).requires_grad_()
    loss, stats = ours(old, logp, torch.tensor([-1.0], dtype=F64), torch.ones(1, 2, dtype=F64))
    (grad,) = torch.autograd.grad(loss, logp)
    w = math.exp(-1.0)
    assert loss.item() == pytest.approx(w * (-2.0 + -3.0) / 2, abs=1e-12)
    torch.testing.assert_close(grad, torch.full((1, 2), w / 2, dtype=F64))
    assert stats["taper_weight_mean"] == pytest.approx(w) and stats["negative_frac"] == 1.0


def test_hand_positive_sequence_ignores_the_ratio_and_the_cap_binds_above_one():
    old = torch.zeros(2, 2, dtype=F64) - 1.0
    logp = (old + torch.tensor([[2.0], [0.5]], dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, stats = ours(old, logp, adv, torch.ones(2, 2, dtype=F64))
    (grad,) = torch.autograd.grad(loss, logp)
    # row 0: w = 1 (A > 0, ρ = e^2 ignored); row 1: ρ = e^0.5 > 1 capped at 1
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]], dtype=F64))
    assert stats["taper_weight_mean"] == pytest.approx(1.0)
    _, raised = ours(old, logp, adv, torch.ones(2, 2, dtype=F64), ratio_high=2.0)
    assert raised["taper_weight_mean"] == pytest.approx((1.0 + math.exp(0.5)) / 2)


def test_paper_trajectory_ratio_multiplies_the_token_ratios():
    # seq_sum: ρ = Π_t ρ_t = e^(−0.5·3); seq_mean: e^−0.5
    old = torch.zeros(1, 3, dtype=F64) - 1.0
    logp = (old - 0.5).requires_grad_()
    adv, mask = torch.tensor([-2.0], dtype=F64), torch.ones(1, 3, dtype=F64)
    for level, w in (("seq_sum", math.exp(-1.5)), ("seq_mean", math.exp(-0.5))):
        loss, stats = ours(old, logp, adv, mask, ratio_level=level)
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, torch.full((1, 3), 2.0 * w / 3, dtype=F64))
        assert stats["taper_weight_mean"] == pytest.approx(w)


# --------------------------------------------------------------------------- properties
def test_on_policy_topr_is_reinforce():
    old, logp, adv, mask = batch(1)
    logp = old.clone().requires_grad_()
    a, _ = losses.surrogate("topr", logp, old, adv, mask)
    b, _ = losses.surrogate("reinforce", logp, old, adv, mask)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    (ga,) = torch.autograd.grad(a.sum(), logp)
    (gb,) = torch.autograd.grad(b.sum(), logp)
    torch.testing.assert_close(ga, gb, atol=0, rtol=0)


def test_negative_gradient_survives_where_ppo_clip_gives_zero():
    old = torch.zeros(2, 4, dtype=F64) - 1.0
    logp = (old - 5.0).requires_grad_()  # ρ = e^−5, far below 1 − ε
    adv, mask = torch.tensor([-1.0, -0.5], dtype=F64), torch.ones(2, 4, dtype=F64)
    ppo, _ = losses.surrogate("ppo_clip", logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    assert (g_ppo == 0).all()
    loss, _ = ours(old, logp, adv, mask)
    (g,) = torch.autograd.grad(loss, logp)
    # seq_mean_token_mean over 2 sequences of 4 tokens: ∂ℓ/∂logp = −A·e^−5 / 8
    torch.testing.assert_close(g, math.exp(-5.0) * (-adv[:, None] / 8).expand(2, 4))


def test_padding_never_reaches_the_weight_or_the_loss():
    old, logp, adv, mask = batch(2)
    corrupt = logp.detach().clone()
    corrupt[mask == 0] = float("nan")
    corrupt.requires_grad_()
    a, _ = ours(old, logp, adv, mask)
    b, _ = ours(old, corrupt, adv, mask)
    torch.testing.assert_close(a, b)
    (g,) = torch.autograd.grad(b, corrupt)
    assert (g[mask == 0] == 0).all()


def test_bad_parameters_are_named():
    old, logp, adv, mask = batch(3)
    with pytest.raises(ValueError, match="ratio_level"):
        losses.surrogate("topr", logp, old, adv, mask, ratio_level="token")
    with pytest.raises(ValueError, match="ratio_high"):
        losses.surrogate("topr", logp, old, adv, mask, ratio_low=0.5, ratio_high=0.2)


# --------------------------------------------------------------------------- verl parity
@pytest.mark.parametrize("seed", [0, 4, 5])
@pytest.mark.parametrize("bounds", [(0.0, 1.0), (0.2, 2.0)])
def test_equal_to_verl_pull_request_6986(seed, bounds):
    old, logp, adv, mask = batch(seed)
    adv_tok = adv[:, None].expand_as(mask) * mask
    want = pr_reference(old, logp, adv_tok, mask, *bounds)
    (want_grad,) = torch.autograd.grad(want, logp)
    got, _ = ours(old, logp, adv, mask, ratio_low=bounds[0], ratio_high=bounds[1])
    (got_grad,) = torch.autograd.grad(got, logp)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)  # the PR's count + 1e-8
    torch.testing.assert_close(got_grad, want_grad, atol=1e-9, rtol=1e-9)


def test_registered_in_verl_reading_the_prs_config_fields():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from omegaconf import OmegaConf

    import grouprl.integrations.verl  # noqa: F401  (registers grouprl_*)

    old, logp, adv, mask = batch(6)
    adv_tok = adv[:, None].expand_as(mask) * mask
    cfg = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "policy_loss": {"topr_negative_ratio_lower": 0.1, "topr_negative_ratio_upper": 1.5},
            "global_batch_info": {},
        }
    )
    fn = core_algos.get_policy_loss_fn("grouprl_topr")
    got, metrics = fn(old, logp, adv_tok, mask, "seq-mean-token-mean", cfg)
    want = pr_reference(old, logp, adv_tok, mask, 0.1, 1.5)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert "actor/grouprl/taper_weight_mean" in metrics
