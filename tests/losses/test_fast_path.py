"""The loss path's fast forms against plain references written here.

Every surrogate and KL estimator computes its per-token value and slope without an autograd
graph (``losses.ratio.linearized``), statistics with dot products and in-place counts
(``ratio_stats``), the top-entropy threshold with a partial selection (``linear_quantile``).
Each is checked against the plain form: the formula in autograd, on ``torch.where``-masked
inputs, in float64; ratio statistics against boolean masks and ``masked_select``; the quantile
against ``torch.quantile``. The cases include active clamps (|log ρ| > 20), per-token
advantages, per-sequence clip bounds, zero advantages and -inf padding.
"""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import losses
from grouprl.losses import ratio as R
from grouprl.losses.aggregation import linear_quantile

DT = torch.float64


def _inputs(seed: int, *, per_token_adv: bool = False, extreme: bool = False):
    g = torch.Generator().manual_seed(seed)
    n, t = 10, 9
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).to(DT)
    old = -torch.rand(n, t, generator=g, dtype=DT) * 2 - 0.05
    logp = (old + 0.4 * torch.randn(n, t, generator=g, dtype=DT)).clamp(max=-1e-4)
    if extreme:  # log-ratios beyond verl's ±20 clamp, both signs
        old[1, 0], old[2, 1] = logp[1, 0] - 30.0, logp[2, 1] + 25.0
    shape = (n, t) if per_token_adv else (n,)
    adv = torch.randn(*shape, generator=g, dtype=DT)
    adv[3] = 0.0
    return logp, old, adv, mask


def _plain(name, lp, old, adv, m, **p):
    """The surrogate's formula in autograd, as the peers write it (the reference)."""
    a = adv if adv.dim() == 2 else adv[:, None]
    valid = m.bool()
    lp = torch.where(valid, lp, torch.zeros((), dtype=DT))
    old = torch.where(valid, old, torch.zeros((), dtype=DT))
    lr = lp - old
    if name == "ppo_clip":
        rho = torch.exp(lr.clamp(-20, 20))
        lo, hi = 1 - p["eps_low"], 1 + p["eps_high"]
        if isinstance(lo, torch.Tensor):
            lo, hi = lo[:, None], hi[:, None]
        loss = torch.maximum(-a * rho, -a * torch.clamp(rho, lo, hi))
        if p.get("clip_ratio_c") is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -a * p["clip_ratio_c"]), loss)
    elif name == "cispo":
        w = torch.exp(lr.clamp(-20, 20)).clamp(1 - p["eps_low"], 1 + p["eps_high"]).detach()
        loss = -w * a * lp
    elif name == "gspo":
        log_s = (lr * m).sum(-1) / m.sum(-1).clamp_min(1)
        tok = log_s.detach()[:, None] + lp - lp.detach()
        rho = torch.exp(tok.clamp(max=10.0))
        loss = torch.maximum(-a * rho, -a * rho.clamp(1 - p["eps_low"], 1 + p["eps_high"]))
    elif name == "reinforce":
        loss = -a * lp
    elif name == "sapo":
        tau = torch.where(a > 0, torch.tensor(1.0, dtype=DT), torch.tensor(1.05, dtype=DT))
        if p.get("level") == "sequence":
            log_s = ((lr * m).sum(-1) / m.sum(-1).clamp_min(1)).clamp(-20, 20)
            rho = torch.exp(log_s.detach()[:, None] + lp - lp.detach())
        else:
            rho = torch.exp(lr.clamp(-20, 20))
        loss = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * a
    elif name == "gmpo":
        c = lr.clamp(-p["eps_low"], p["eps_high"])
        c = torch.where(a > 0, torch.minimum(lr, c), torch.maximum(lr, c))
        log_s = (c * m).sum(-1) / m.sum(-1).clamp_min(1)
        s_adv = a if a.shape[-1] == 1 else ((a * m).sum(-1) / m.sum(-1).clamp_min(1))[:, None]
        loss = -s_adv * torch.exp(log_s.detach()[:, None] + c - c.detach())
    elif name == "dro":
        loss = -(a * lp - 0.5 * p["beta"] * lr.square())
    elif name == "kl_cov":
        rho = torch.exp(lr)
        loss = -a * rho + p["ppo_kl_coef"] * lr.abs() * p["selected"]
    elif name == "clip_cov":
        rho = torch.exp(lr)
        loss = torch.maximum(-a * rho, -a * rho.clamp(0.8, 1.2)) * (1 - p["selected"])
    else:  # dppo_tv with C = 20
        rho = torch.exp(lr.clamp(-20, 20))
        prob, prob_old = torch.exp(lp.detach()), torch.exp(old)
        ok = torch.where(a > 0, prob - prob_old <= 0.2, prob - prob_old >= -0.2).to(DT)
        loss = -a * rho.clamp(max=20.0).detach() * lp * ok
    return torch.where(valid, loss, torch.zeros((), dtype=DT))


CASES = [
    ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}),
    ("ppo_clip", {"eps_low": 0.05, "eps_high": 0.1, "clip_ratio_c": 3.0}),
    ("cispo", {"eps_low": 0.9, "eps_high": 0.2}),
    ("gspo", {"eps_low": 0.02, "eps_high": 0.03}),
    ("reinforce", {}),
    ("sapo", {}),
    ("sapo", {"level": "sequence"}),
    ("gmpo", {"eps_low": 0.1, "eps_high": 0.2}),
    ("dro", {"beta": 0.3}),
    ("dppo_tv", {}),
]


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize(("name", "params"), CASES)
def test_value_and_gradient_equal_the_plain_autograd_form(name, params, per_token_adv, extreme):
    logp, old, adv, mask = _inputs(3, per_token_adv=per_token_adv, extreme=extreme)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    lp1 = logp.clone().requires_grad_()
    ours, _ = losses.surrogate(name, lp1, old, adv, mask, **params)
    (ours * weights).sum().backward()  # per-token weights: every slope is checked
    lp2 = logp.clone().requires_grad_()
    want = _plain(name, lp2, old, adv, mask, **params)
    (want * weights).sum().backward()
    torch.testing.assert_close(ours.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["kl_cov", "clip_cov"])
def test_covariance_surrogates_with_a_given_selection(name):
    logp, old, adv, mask = _inputs(4, extreme=name == "kl_cov")
    selected = torch.zeros_like(mask)
    selected[0, :3] = selected[5, 0] = 1.0
    params = {"selected": selected.bool()}
    params.update(ppo_kl_coef=0.7) if name == "kl_cov" else params.update(eps_low=0.2)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, _ = losses.surrogate(name, lp1, old, adv, mask, **params)
    want = _plain(name, lp2, old, adv, mask, ppo_kl_coef=0.7, selected=selected)
    weights = torch.arange(1.0, 1.0 + mask.numel(), dtype=DT).view(mask.shape)
    (ours * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(ours.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


def test_per_sequence_clip_bounds_equal_the_plain_form():
    logp, old, adv, mask = _inputs(5, extreme=True)
    eps = torch.linspace(0.05, 0.4, logp.shape[0], dtype=DT)
    params = {"eps_low": eps, "eps_high": eps * 1.5, "clip_ratio_c": 2.0}
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, _ = losses.surrogate("ppo_clip", lp1, old, adv, mask, **params)
    want = _plain("ppo_clip", lp2, old, adv, mask, **params)
    ours.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(ours.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


def _plain_kl(name, lp, ref):
    d = lp - ref
    base = name.rstrip("+")
    if base == "k1":
        value = d
    elif base == "k2":
        value = 0.5 * d.square()
    elif base == "abs":
        value = d.abs()
    else:
        x = (ref - lp).clamp(-20, 20)
        value = (torch.exp(x) - x - 1).clamp(-10, 10)
    if name.endswith("+"):
        k2 = 0.5 * d.square()
        value = value.detach() + k2 - k2.detach()
    return value


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_kl_value_and_gradient_equal_the_plain_form(name):
    logp, *_ = _inputs(6)
    ref = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ref[0, 0], ref[1, 1] = logp[0, 0] + 25.0, logp[1, 1] - 3.0  # both k3 clamps act
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, want = losses.kl(name, lp1, ref), _plain_kl(name, lp2, ref)
    (ours * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(ours.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("correction", ["ratio", "straight_through", "sequence_ratio"])
def test_kl_corrections_equal_the_plain_form(correction):
    logp, old, _, mask = _inputs(7)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours = losses.kl_corrected("k3", lp1, ref, old, mask, correction=correction)
    value = _plain_kl("k3", lp2, ref)
    if correction == "ratio":
        want = torch.exp(lp2 - old) * value
    elif correction == "sequence_ratio":
        log_s = ((lp2 - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        want = torch.exp(log_s) * value
    else:
        k2 = torch.exp(lp2 - old).clamp(max=10.0).detach() * 0.5 * (lp2 - ref).square()
        want = value.detach() + k2 - k2.detach()
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    (ours * weights * mask).sum().backward()
    (want * weights * mask).sum().backward()
    torch.testing.assert_close(ours.detach(), want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_stats_false_gives_the_same_loss_and_gradient_and_no_stats(name):
    logp, old, adv, mask = _inputs(8)
    params = {"beta": 0.2} if name == "dro" else {}
    grads, losses_, stats = [], [], []
    for flag in (True, False):
        lp = logp.clone().requires_grad_()
        torch.manual_seed(0)  # Clip-Cov's draw
        out = losses.objective(
            lp, old, adv, mask, surrogate=name, surrogate_params=params, stats=flag,
            ref_logp=logp.detach() - 0.1, beta=0.05, aggregation="seq_mean_token_mean",
        )  # fmt: skip
        out.loss.backward()
        grads.append(lp.grad)
        losses_.append(out.loss.detach())
        stats.append(out.stats)
    assert torch.equal(losses_[0], losses_[1]) and torch.equal(grads[0], grads[1])
    assert stats[1] == {} and {"ratio_mean", "pg_loss", "kl_mean", "kept_frac"} <= set(stats[0])


def _masked_reference(ratio, adv, mask, lo, hi, log_ratio, any_sign=False, cap=None):
    r = ratio.expand_as(mask)
    a = adv.expand_as(mask)
    valid = mask.bool()
    n = mask.sum()
    sel = torch.masked_select
    low = (r < lo) & (valid if any_sign else valid & (a < 0)) if lo is not None else None
    high = (r > hi) & (valid if any_sign else valid & (a > 0)) if hi is not None else None
    out = {
        "ratio_mean": sel(r, valid).sum() / n,
        "ratio_min": sel(r, valid).min(),
        "ratio_max": sel(r, valid).max(),
        "approx_kl": -sel(log_ratio.expand_as(mask), valid).sum() / n,
        "clip_frac_low": 0.0 if low is None else low.sum() / n,
        "clip_frac_high": 0.0 if high is None else high.sum() / n,
    }
    out["clip_frac_region"] = out["clip_frac_low"] + out["clip_frac_high"]
    if cap is not None:
        out["clip_frac_dual"] = ((r > cap) & valid & (a < 0)).sum() / n
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize(
    "shift", [0.0, 0.5, -0.5, "ones"]
)  # both sides of 1, all above, all below, all equal
@pytest.mark.parametrize("padding", [None, 1.0])
def test_ratio_stats_equal_a_masked_select_reference(shift, padding):
    logp, old, adv, mask = _inputs(11)
    lr = ((logp - old) * mask) if shift != "ones" else torch.zeros_like(mask)
    if shift not in ("ones", 0.0):
        lr = (lr.abs() + 0.01) * (1 if shift > 0 else -1) * mask
    ratio = torch.exp(lr)  # 1 at padding
    a = adv[:, None]
    lo = 1 - torch.linspace(0.01, 0.3, len(adv), dtype=DT)[:, None]
    for kw in ({"lo": 0.9, "hi": 1.1, "cap": 1.3}, {"lo": lo, "hi": 2 - lo}, {"any_sign": True}):
        bounds = {"lo": kw.get("lo", 0.95), "hi": kw.get("hi", 1.05)}
        extra = {k: v for k, v in kw.items() if k in ("cap", "any_sign")}
        tied = ratio.clone()  # ratios exactly on a bound count as inside (strict <, >)
        for col, key in enumerate(("lo", "hi")):
            bound = bounds[key]
            tied[0, col] = bound[0, 0] if isinstance(bound, torch.Tensor) else bound
        if shift == "ones":
            tied = ratio
        got = losses.surrogates.to_floats(
            R.ratio_stats(tied, a, mask, **bounds, log_ratio=lr, padding=padding, **extra)
        )
        want = _masked_reference(tied, a, mask, **bounds, log_ratio=lr, **extra)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_ratio_stats_of_one_ratio_per_sequence():
    logp, old, adv, mask = _inputs(12)
    mask[4] = 0.0  # a row without a valid token leaves min and max alone
    s = torch.exp(torch.randn(len(adv), 1, dtype=DT) * 0.1)
    s[4] = 100.0
    got = losses.surrogates.to_floats(
        R.ratio_stats(s, adv[:, None], mask, 0.95, 1.05, log_ratio=(logp - old) * mask, cap=1.1)
    )
    want = _masked_reference(s, adv[:, None], mask, 0.95, 1.05, (logp - old) * mask, cap=1.1)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_linear_quantile_equals_torch_quantile_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        n = int(torch.randint(1, 2000, (1,), generator=g))
        q = [0.0, 0.8, 0.5, 1.0][trial % 4] if trial % 2 else float(torch.rand(1, generator=g))
        dtype = torch.float64 if trial % 3 == 0 else torch.float32
        values = torch.rand(n, generator=g, dtype=dtype) * 3
        if trial % 5 == 0:
            values = torch.round(values * 4) / 4  # ties
        assert torch.equal(linear_quantile(values, q), torch.quantile(values, q)), (n, q)


def test_the_gradient_is_first_order_only():
    logp, old, adv, mask = _inputs(13)
    lp = logp.clone().requires_grad_()
    per_token, _ = losses.surrogate("ppo_clip", lp, old, adv, mask)
    (g,) = torch.autograd.grad(per_token.sum(), lp, create_graph=True)
    assert not g.requires_grad  # no graph to differentiate again
    upstream = torch.ones_like(per_token, requires_grad=True)  # a double-backward chain
    (g,) = torch.autograd.grad(per_token, lp, upstream, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_objective_loss_stays_finite_with_minus_inf_padding():
    # -inf log-probs at padded positions: the loss, its branches and the statistics are the
    # ones of the same batch with the padding zero-filled (the objective once added
    # logp.sum() * 0 for its unused branches, which made the loss NaN here)
    logp, old, adv, mask = _inputs(14)
    padded = logp.masked_fill(mask == 0, -math.inf).requires_grad_()
    clean = (logp * mask).requires_grad_()
    outs = [
        losses.objective(lp, old, adv, mask, aggregation="token_mean") for lp in (padded, clean)
    ]
    for out in outs:
        out.loss.backward()
    assert torch.isfinite(outs[0].loss) and outs[0].loss == outs[1].loss
    assert outs[0].kl_loss == 0 and outs[0].stats == outs[1].stats
    assert torch.equal(padded.grad, clean.grad)


def test_bfloat16_logp_gets_a_bfloat16_gradient():
    logp, old, adv, mask = _inputs(15)
    lp = logp.to(torch.bfloat16).requires_grad_()
    out = losses.objective(lp, old.float(), adv.float(), mask.float(), surrogate="gspo")
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


def test_masks_are_read_as_nonzero_whatever_their_dtype():
    logp, old, adv, mask = _inputs(16)
    ref, _ = losses.surrogate("ppo_clip", logp, old, adv, mask)
    for other in (mask.bool(), mask.long(), mask * 0.5, mask.float()):
        got, _ = losses.surrogate("ppo_clip", logp, old, adv, other)
        torch.testing.assert_close(got, ref, atol=0, rtol=0, check_dtype=False)
