"""Every hand-differentiated loss equals its plain autograd form, and every public table is what
the public functions compute.

Each surrogate of :data:`losses.SURROGATES` computes its value and slope by hand
(``losses.ratio.linearized``); :data:`losses.AUTOGRAD_FORMS` holds the same formula written in
autograd beside it. Over the whole registry, with active clamps (|log ρ| > 20), per-token
advantages, a zero-advantage row and ``-inf`` padding, in float64, value and gradient agree to
1e-12. The same for :func:`losses.kl` against :func:`losses.kl_autograd` (which is
:data:`losses.KL_ESTIMATORS` and the straight-through k2), for every name :func:`losses.kl_names`
lists, and for the KL corrections; and :func:`losses.objective`'s KL branch is
``KL_ESTIMATORS``' value. A surrogate or KL estimator registered without a plain form fails here.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from grouprl import losses
from grouprl.losses.aggregation import _REDUCTIONS

DT = torch.float64


def _inputs(seed: int, *, per_token_adv: bool = False, extreme: bool = False):
    g = torch.Generator().manual_seed(seed)
    n, t = 10, 9
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).to(DT)
    old = -torch.rand(n, t, generator=g, dtype=DT) * 2 - 0.05
    logp = (old + 0.4 * torch.randn(n, t, generator=g, dtype=DT)).clamp(max=-1e-4)
    if extreme:  # log-ratios beyond the ±20 clamps, both signs
        old[1, 0], old[2, 1] = logp[1, 0] - 30.0, logp[2, 1] + 25.0
    logp = torch.where(mask.bool(), logp, torch.tensor(-torch.inf, dtype=DT))  # -inf padding
    shape = (n, t) if per_token_adv else (n,)
    adv = torch.randn(*shape, generator=g, dtype=DT)
    adv[3] = 0.0
    return logp, old, adv, mask


def _selected(mask: torch.Tensor) -> torch.Tensor:
    s = torch.zeros_like(mask, dtype=torch.bool)
    s[0, :3] = s[5, 0] = True
    return s


# The parameters each surrogate is run with besides its defaults (a name missing here runs
# with its defaults only); "selected" is filled in per input.
CASES: dict[str, list[dict]] = {
    "ppo_clip": [{}, {"eps_low": 0.05, "eps_high": 0.1, "clip_ratio_c": 3.0}],
    "cispo": [{}, {"eps_low": 0.9, "eps_high": 0.2}],
    "gspo": [{}, {"eps_low": 0.02, "eps_high": 0.03, "log_ratio_max": 0.05}],
    "sapo": [{}, {"level": "sequence", "tau_pos": 0.5, "tau_neg": 2.0}],
    "gmpo": [{}, {"eps_low": 0.1, "eps_high": 0.2, "log_ratio_clamp": 20.0}],
    "vespo": [{}, {"k_pos": 1.0, "lambda_neg": 0.5}],
    "clip_cov": [{"selected": True}, {"selected": True, "log_ratio_clamp": 20.0}],
    "kl_cov": [{"selected": True, "ppo_kl_coef": 0.7}, {"kl_cov_ratio": 0.1}],
    "dppo_tv": [{}, {"delta_low": 0.05, "delta_high": 0.1, "clip_ratio_c": 1.5}],
    "dppo_kl": [{}, {"delta_low": 0.01, "delta_high": 0.02}],
    "dro": [{"beta": 0.3}],
}


def _cases():
    for name in losses.SURROGATES:
        for i, params in enumerate(CASES.get(name, [{}])):
            yield pytest.param(name, params, id=f"{name}-{i}")


def test_every_surrogate_has_a_plain_form_with_its_parameters():
    assert set(losses.AUTOGRAD_FORMS) == set(losses.SURROGATES)
    for name, fast in losses.SURROGATES.items():
        want = {
            k: p.default
            for k, p in inspect.signature(fast).parameters.items()
            if p.kind is p.KEYWORD_ONLY and k != "stats"
        }
        got = {
            k: p.default
            for k, p in inspect.signature(losses.AUTOGRAD_FORMS[name]).parameters.items()
            if p.kind is p.KEYWORD_ONLY
        }
        assert got == want, name


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv_N", "adv_NT"])
@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "clamps"])
@pytest.mark.parametrize(("name", "params"), _cases())
def test_value_and_gradient_equal_the_autograd_form(name, params, per_token_adv, extreme):
    logp, old, adv, mask = _inputs(3, per_token_adv=per_token_adv, extreme=extreme)
    params = dict(params)
    if params.get("selected"):
        params["selected"] = _selected(mask)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    fast, _ = losses.surrogate(name, lp1, old, adv, mask, **params)
    plain = losses.AUTOGRAD_FORMS[name](lp2, old, adv, mask, **params)
    (fast * weights).sum().backward()  # per-token weights: every slope is checked
    (plain * weights).sum().backward()
    torch.testing.assert_close(fast.detach(), plain.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)
    assert bool(torch.isfinite(lp1.grad).all())


def test_clip_cov_draws_the_same_tokens_in_both_forms():
    logp, old, adv, mask = _inputs(4)
    params = {"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    fast, stats = losses.surrogate("clip_cov", lp1, old, adv, mask, generator=g1, **params)
    plain = losses.AUTOGRAD_FORMS["clip_cov"](lp2, old, adv, mask, generator=g2, **params)
    assert stats["cov_frac"] > 0  # the draw selected tokens
    fast.sum().backward()
    plain.sum().backward()
    torch.testing.assert_close(fast.detach(), plain.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- KL


def _kl_inputs():
    logp, *_ = _inputs(6)
    logp = logp.clamp_min(-5.0)
    ref = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    ref[0, 0], ref[1, 1] = logp[0, 0] + 25.0, logp[1, 1] - 3.0  # both k3 clamps act
    return logp, ref


@pytest.mark.parametrize("name", losses.kl_names())
def test_kl_is_its_autograd_form_for_every_name(name):
    logp, ref = _kl_inputs()
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    fast, plain = losses.kl(name, lp1, ref), losses.kl_autograd(name, lp2, ref)
    (fast * weights).sum().backward()
    (plain * weights).sum().backward()
    torch.testing.assert_close(fast.detach(), plain.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(losses.KL_ESTIMATORS))
def test_the_kl_table_is_what_kl_computes(name):
    logp, ref = _kl_inputs()
    torch.testing.assert_close(
        losses.kl(name, logp, ref), losses.KL_ESTIMATORS[name](logp, ref), atol=0, rtol=0
    )


def test_k3_known_values():
    # k3 = e^d − d − 1, d = ref − logp: d = 0 -> 0; d = 1 -> e − 2; d = −1 -> 1/e
    logp = torch.zeros(1, 3, dtype=DT)
    ref = torch.tensor([[0.0, 1.0, -1.0]], dtype=DT)
    want = torch.tensor([[0.0, torch.e - 2.0, 1.0 / torch.e]], dtype=DT)
    torch.testing.assert_close(losses.KL_ESTIMATORS["k3"](logp, ref), want)
    torch.testing.assert_close(losses.kl("k3", logp, ref), want)


@pytest.mark.parametrize("correction", list(losses.KL_CORRECTIONS))
@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k3+"])
def test_kl_corrections_are_their_autograd_form(name, correction):
    logp, ref = _kl_inputs()
    _, old, _, mask = _inputs(7)
    old = old.clamp_min(-5.0)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    fast = losses.kl_corrected(name, lp1, ref, old, mask, correction=correction)
    plain = losses.kl_corrected_autograd(name, lp2, ref, old, mask, correction=correction)
    (fast * weights * mask).sum().backward()
    (plain * weights * mask).sum().backward()
    valid = mask.bool()
    torch.testing.assert_close(fast.detach()[valid], plain.detach()[valid], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(losses.KL_ESTIMATORS))
def test_the_objectives_kl_branch_is_the_table(name):
    logp, ref = _kl_inputs()
    mask = torch.ones_like(logp)
    adv = torch.zeros(logp.shape[0], dtype=DT)
    beta = 0.25
    out = losses.objective(
        logp, None, adv, mask, surrogate="reinforce", ref_logp=ref, kl=name, beta=beta
    )
    want = beta * losses.KL_ESTIMATORS[name](logp, ref).mean()
    torch.testing.assert_close(out.kl_loss.detach(), want, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("name", list(losses.AGGREGATIONS))
def test_the_aggregation_table_is_what_the_objective_reduces_with(name):
    per_token, _, _, mask = _inputs(8)
    per_token = torch.where(mask.bool(), per_token, torch.zeros((), dtype=DT))
    assert set(_REDUCTIONS) == set(losses.AGGREGATIONS)
    torch.testing.assert_close(
        losses.AGGREGATIONS[name](per_token, mask, None),
        losses.aggregation.reduce_masked(name, per_token, mask),
        atol=0,
        rtol=0,
    )
