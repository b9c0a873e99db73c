"""The loss-side methods: hand-derived values, exact gradient accumulation for every
surrogate × aggregation, the step-level batch statistics (covariance selection, entropy
threshold), the KL names and corrections, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import losses

F64 = torch.float64


def _t(rows, **kw):
    return torch.tensor(rows, dtype=F64, **kw)


def _loss_and_grad(name, logp, old, adv, mask, agg="token_sum", **params):
    lp = logp.detach().clone().requires_grad_()
    per_token, stats = losses.surrogate(name, lp, old, adv, mask, **params)
    loss = losses.aggregate(agg, per_token, mask)
    loss.backward()
    return per_token.detach(), lp.grad, stats


# ----------------------------------------------------------------------------- hand values


def test_sapo_hand_values():
    # on-policy (ρ = 1): f(1) = σ(0)·4/τ = 2/τ, f'(1) = 4·σ(0)(1 − σ(0)) = 1
    # row 0: A = +1, τ_pos = 1 -> ℓ = −2, dℓ/dlogp = −A·f'(1)·ρ = −1
    # row 1: A = −1, τ_neg = 2 -> ℓ = +1, gradient +1
    logp = _t([[-0.5], [-1.0]])
    per_token, grad, stats = _loss_and_grad(
        "sapo", logp, logp, _t([1.0, -1.0]), torch.ones(2, 1), tau_pos=1.0, tau_neg=2.0
    )
    torch.testing.assert_close(per_token, _t([[-2.0], [1.0]]))
    torch.testing.assert_close(grad, _t([[-1.0], [1.0]]))
    assert stats["gate_mean"] == pytest.approx(1.5)
    # off-policy: ρ = 2, τ = 1, A = 1: ℓ = −σ(1)·4 = −2.92423; d/dlogp = −4σ(1)(1 − σ(1))·ρ
    s = 1 / (1 + math.exp(-1))
    per_token, grad, _ = _loss_and_grad(
        "sapo", _t([[math.log(2.0)]]), _t([[0.0]]), _t([1.0]), torch.ones(1, 1)
    )
    assert float(per_token) == pytest.approx(-4 * s, abs=1e-12)
    assert float(grad) == pytest.approx(-4 * s * (1 - s) * 2, abs=1e-12)


def test_gmpo_hand_values():
    # A = +1, log ρ = (0.1, 0.5), ε 0.4: clipped (0.1, 0.4), mean 0.25, s = e^0.25,
    # ℓ_i = −s = −1.28403; the gradient reaches token 1 only: −s·(1/2 tokens)·(1/2 sequences);
    # token 2 is clipped. A = −1, log ρ = (−0.5, 0.2): max with the clamp gives (−0.4, 0.2),
    # mean −0.1, ℓ = +e^−0.1; token 1 clipped, token 2 gets +e^−0.1/4.
    old = _t([[-1.0, -1.0], [-1.0, -1.0]])
    logp = old + _t([[0.1, 0.5], [-0.5, 0.2]])
    per_token, grad, stats = _loss_and_grad(
        "gmpo", logp, old, _t([1.0, -1.0]), torch.ones(2, 2), agg="seq_mean_token_mean"
    )
    s0, s1 = math.exp(0.25), math.exp(-0.1)
    torch.testing.assert_close(per_token, _t([[-s0, -s0], [s1, s1]]))
    torch.testing.assert_close(grad, _t([[-s0 / 4, 0.0], [0.0, s1 / 4]]))
    assert stats["clip_frac_high"] == 0.25 and stats["clip_frac_low"] == 0.25


def test_vespo_hand_values():
    # Σ log ρ = ln 2 -> w = 2; A ≥ 0: k = 2, λ = 3: φ = e^(3 + 2 ln 2 − 6) = 4e^−3 = 0.199148
    # ℓ_t = −φ·A·logp_t, gradient −φ·A per token (φ carries none)
    old = _t([[-1.0, -2.0]])
    logp = old + _t([[0.5 * math.log(2.0), 0.5 * math.log(2.0)]])
    per_token, grad, stats = _loss_and_grad("vespo", logp, old, _t([1.0]), torch.ones(1, 2))
    phi = 4 * math.exp(-3)
    torch.testing.assert_close(per_token, -phi * logp)
    torch.testing.assert_close(grad, _t([[-phi, -phi]]))
    assert stats["phi_mean"] == pytest.approx(phi)
    # A < 0 takes (k 3, λ 2): φ = e^(2 + 3 ln 2 − 4) = 8e^−2
    _, grad, _ = _loss_and_grad("vespo", logp, old, _t([-1.0]), torch.ones(1, 2))
    torch.testing.assert_close(grad, _t([[8 * math.exp(-2)] * 2]))


def test_kl_cov_hand_values():
    # A = (+1, −1) per sequence, logp = [[−1, −2], [−3, −0.5]]: means 0 and −1.625, covariance
    # terms [[0.625, −0.375], [1.375, −1.125]]; ratio 0.25 of 4 tokens -> the top 1: (1, 0).
    logp = _t([[-1.0, -2.0], [-3.0, -0.5]])
    old = logp - _t([[0.0, 0.0], [0.5, 0.0]])  # log ρ = 0.5 at (1, 0)
    adv, mask = _t([1.0, -1.0]), torch.ones(2, 2)
    cov = losses.covariance.token_covariance(logp, adv[:, None], mask)
    torch.testing.assert_close(cov, _t([[0.625, -0.375], [1.375, -1.125]]))
    per_token, _, stats = _loss_and_grad(
        "kl_cov", logp, old, adv, mask, kl_cov_ratio=0.25, ppo_kl_coef=2.0
    )
    # (1, 0): −(−1)·e^0.5 + 2·0.5; elsewhere −A·1
    torch.testing.assert_close(per_token, _t([[-1.0, -1.0], [math.exp(0.5) + 1.0, 1.0]]))
    assert stats["cov_frac"] == 0.25


def test_clip_cov_hand_values():
    # every token's covariance term is 2 (A = ±2, logp = −1 / −3 around the mean −2), all are
    # candidates in (1, 5) and unclipped at ρ = 1; ratio 0.5 of 4 tokens -> 2 drawn
    logp = _t([[-1.0, -1.0], [-3.0, -3.0]])
    adv, mask = _t([2.0, -2.0]), torch.ones(2, 2)
    cov = losses.covariance.token_covariance(logp, adv[:, None], mask)
    torch.testing.assert_close(cov, torch.full((2, 2), 2.0, dtype=F64))
    gen = torch.Generator().manual_seed(0)
    per_token, _, stats = _loss_and_grad(
        "clip_cov", logp, logp, adv, mask, clip_cov_ratio=0.5, generator=gen
    )
    dropped = per_token == 0
    assert int(dropped.sum()) == 2 and stats["cov_frac"] == 0.5
    torch.testing.assert_close(per_token[~dropped], (-adv[:, None].expand(2, 2))[~dropped])
    # a bound that excludes 2 leaves every token
    per_token, _, _ = _loss_and_grad("clip_cov", logp, logp, adv, mask, clip_cov_ub=2.0)
    assert bool((per_token != 0).all())


def test_dppo_hand_values():
    # p_old = 0.5, p = 0.7: p − p_old = 0.2; binary KL(0.5‖0.7) = 0.5 ln(5/7) + 0.5 ln(5/3)
    logp, old, mask = _t([[math.log(0.7)]]), _t([[math.log(0.5)]]), torch.ones(1, 1)
    bkl = 0.5 * math.log(5 / 7) + 0.5 * math.log(5 / 3)
    assert float(losses.trust_region.binary_kl(old, logp)) == pytest.approx(bkl, abs=1e-7)
    # A > 0 pushing p further up past δ_high = 0.1: masked (loss and gradient 0)
    per_token, grad, stats = _loss_and_grad("dppo_tv", logp, old, _t([1.0]), mask, delta_high=0.1)
    assert float(per_token) == 0.0 and float(grad) == 0.0 and stats["clip_frac_region"] == 1.0
    # A < 0: p went up, the update pulls it back down: kept. ℓ = −A·min(1.4, C)·ln 0.7
    per_token, grad, _ = _loss_and_grad("dppo_tv", logp, old, _t([-1.0]), mask, delta_high=0.1)
    assert float(per_token) == pytest.approx(1.4 * math.log(0.7))
    assert float(grad) == pytest.approx(1.4)
    # the truncation C caps the weight: C = 1.2 -> gradient 1.2
    _, grad, _ = _loss_and_grad("dppo_tv", logp, old, _t([-1.0]), mask, clip_ratio_c=1.2)
    assert float(grad) == pytest.approx(1.2)
    # binary KL 0.0872: masked at δ = 0.05, kept at δ = 0.1
    for delta, kept in ((0.05, False), (0.1, True)):
        per_token, _, _ = _loss_and_grad("dppo_kl", logp, old, _t([1.0]), mask, delta_high=delta)
        assert (float(per_token) != 0.0) == kept


def test_dro_hand_values():
    # ℓ = −(A·logp − ½β(logp − old)²): A 1, logp −1, old −1.5, β 0.5 -> 1 + 0.0625;
    # gradient −A + β·(logp − old) = −1 + 0.25
    per_token, grad, _ = _loss_and_grad(
        "dro", _t([[-1.0]]), _t([[-1.5]]), _t([1.0]), torch.ones(1, 1), beta=0.5
    )
    assert float(per_token) == pytest.approx(1.0625) and float(grad) == pytest.approx(-0.75)


def test_kl_names_and_straight_through():
    logp = _t([[-1.0, -2.0]], requires_grad=True)
    ref = _t([[-1.5, -1.0]])
    d = logp.detach() - ref  # (0.5, −1)
    assert torch.equal(losses.kl("abs", logp, ref).detach(), d.abs())
    for alias, name in losses.KL_ALIASES.items():
        assert torch.equal(losses.kl(alias, logp, ref), losses.kl(name, logp, ref))
    # k3+: the value of k3, the gradient of k2 = logp − ref
    value = losses.kl("k3+", logp, ref)
    torch.testing.assert_close(value.detach(), losses.kl("k3", logp, ref).detach())
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, d)
    # k3's own gradient is 1 − e^(ref − logp): not k2's
    (own,) = torch.autograd.grad(losses.kl("k3", logp, ref).sum(), logp)
    torch.testing.assert_close(own, 1 - torch.exp(-d))


def test_kl_corrections_hand_values():
    # one token: logp −1, old −1.5 (ρ = e^0.5), ref −1.2 (d = logp − ref = 0.2)
    logp = _t([[-1.0]], requires_grad=True)
    old, ref, mask = _t([[-1.5]]), _t([[-1.2]]), torch.ones(1, 1)
    rho, d = math.exp(0.5), 0.2
    k3 = math.exp(-d) + d - 1
    out = losses.kl_corrected("k3", logp, ref, old, mask, correction="ratio")
    (grad,) = torch.autograd.grad(out.sum(), logp)
    # TRL: value ρ·k3; gradient ρ·k3 + ρ·(1 − e^−d) = ρ·d (the unbiased reverse-KL gradient)
    assert float(out.detach()) == pytest.approx(rho * k3) and float(grad) == pytest.approx(rho * d)
    out = losses.kl_corrected("k3", logp, ref, old, mask, correction="straight_through")
    (grad,) = torch.autograd.grad(out.sum(), logp)
    # OpenRLHF: value k3, gradient min(ρ, 10)·d; with the cap at 1.2: 1.2·d
    assert float(out.detach()) == pytest.approx(k3) and float(grad) == pytest.approx(rho * d)
    out = losses.kl_corrected(
        "k1", logp, ref, old, mask, correction="straight_through", weight_clip=1.2
    )
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert float(out.detach()) == pytest.approx(d) and float(grad) == pytest.approx(1.2 * d)


# ----------------------------------------------------------------------------- accumulation


def _batch(seed: int, n: int = 9, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    old = -torch.rand(n, t, generator=g, dtype=F64) * 2 - 0.05
    logp = (old + 0.3 * torch.randn(n, t, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = logp + 0.2 * torch.randn(n, t, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    entropy = torch.rand(n, t, generator=g, dtype=F64)
    return logp, old, ref, adv, mask, entropy


PARAMS = {
    "dro": {"beta": 0.2},
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.2},
}
SLICES = (slice(0, 2), slice(2, 6), slice(6, 9))


def _step_selection(name, logp, old, adv, mask, parts):
    """The step-level Clip-Cov / KL-Cov selection: one batch, and its micro-batch pieces."""
    kw = {k: v for k, v in PARAMS[name].items()}
    if name == "clip_cov":
        whole = losses.clip_cov_select(
            logp, old, adv, mask, generator=torch.Generator().manual_seed(0), **kw
        )
        pieces = losses.clip_cov_select(
            [logp[s, :w] for s, w in parts], [old[s, :w] for s, w in parts], [adv[s] for s, _ in parts],
            [mask[s, :w] for s, w in parts], generator=torch.Generator().manual_seed(0), **kw,
        )  # fmt: skip
    else:
        whole = losses.kl_cov_select(logp, adv, mask, **kw)
        pieces = losses.kl_cov_select(
            [logp[s, :w] for s, w in parts], [adv[s] for s, _ in parts], [mask[s, :w] for s, w in parts], **kw
        )  # fmt: skip
    return whole, pieces


@pytest.mark.parametrize("aggregation", sorted(losses.EXACT_UNDER_ACCUMULATION))
@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_every_surrogate_accumulates_exactly(name, aggregation):
    # one batch vs three micro-batches trimmed to their own widths, with the step's totals
    # (and, for Clip-Cov / KL-Cov, the step-level selection): losses sum, gradients add up
    logp, old, ref, adv, mask, _ = _batch(0)
    parts = [(s, int(mask[s].sum(-1).max())) for s in SLICES]
    params = dict(PARAMS.get(name, {}))
    sel = {}
    if name in ("clip_cov", "kl_cov"):
        whole, pieces = _step_selection(name, logp, old, adv, mask, parts)
        sel = {"whole": whole, "pieces": pieces}
    if name == "clip_cov":
        for key in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"):
            params.pop(key)
    if name == "kl_cov":
        params.pop("kl_cov_ratio")

    def run(lp, o, a, m, r, totals, selected=None):
        extra = {} if selected is None else {"selected": selected}
        return losses.objective(
            lp, o, a, m, surrogate=name, surrogate_params={**params, **extra},
            aggregation=aggregation, totals=totals, ref_logp=r, beta=0.05, kl="k3+",
        ).loss  # fmt: skip

    lp = logp.detach().clone().requires_grad_()
    full = run(lp, old, adv, mask, ref, None, sel.get("whole"))
    (g_full,) = torch.autograd.grad(full, lp)
    totals = losses.step_totals([mask[s, :w] for s, w in parts])
    acc, grad = torch.zeros((), dtype=F64), torch.zeros_like(logp)
    for i, (s, w) in enumerate(parts):
        lp = logp.detach()[s, :w].clone().requires_grad_()
        piece = sel["pieces"][i] if sel else None
        loss = run(lp, old[s, :w], adv[s], mask[s, :w], ref[s, :w], totals, piece)
        loss.backward()
        acc, grad[s, :w] = acc + loss.detach(), grad[s, :w] + lp.grad
    torch.testing.assert_close(acc, full.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grad, g_full, atol=1e-12, rtol=1e-12)
    if sel:  # the selection acts: some tokens are selected
        assert 0 < int(sel["whole"].sum()) < int(mask.sum())


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_micro_batch_local_selection_is_the_peer_reading_and_differs(name):
    # without a step-level selection each micro-batch selects its own tokens (verl); the
    # count alone differs (max(⌊r·n_micro⌋, 1) per micro-batch vs ⌊r·n_step⌋ once)
    logp, old, _ref, adv, mask, _ = _batch(1, n=12)
    parts = [(slice(0, 6), 6), (slice(6, 12), 6)]
    whole, _ = _step_selection(name, logp, old, adv, mask, parts)
    local = [
        _step_selection(name, logp[s], old[s], adv[s], mask[s], [(slice(0, 6), w)])[0]
        for s, w in parts
    ]
    assert not torch.equal(torch.cat(local), whole)


def test_top_entropy_step_threshold_makes_micro_batches_exact():
    logp, old, _ref, adv, mask, entropy = _batch(3)
    parts = [(s, int(mask[s].sum(-1).max())) for s in SLICES]
    kw = {"surrogate": "ppo_clip", "aggregation": "token_mean", "top_entropy_quantile": 0.3}
    lp = logp.detach().clone().requires_grad_()
    full = losses.objective(lp, old, adv, mask, entropy=entropy, **kw)
    (g_full,) = torch.autograd.grad(full.loss, lp)
    assert 0.25 < full.stats["entropy_mask_frac"] < 0.35  # ~30 % of the tokens kept
    totals = losses.step_totals(
        [mask[s, :w] for s, w in parts],
        entropies=[entropy[s, :w] for s, w in parts],
        top_entropy_quantile=0.3,
    )
    acc, grad = 0.0, torch.zeros_like(logp)
    for s, w in parts:
        lp = logp.detach()[s, :w].clone().requires_grad_()
        out = losses.objective(
            lp, old[s, :w], adv[s], mask[s, :w], entropy=entropy[s, :w], totals=totals, **kw
        )
        out.loss.backward()
        acc, grad[s, :w] = acc + float(out.loss.detach()), grad[s, :w] + lp.grad
    assert acc == pytest.approx(float(full.loss.detach()), abs=1e-12)
    torch.testing.assert_close(grad, g_full, atol=1e-12, rtol=0)
    # TRL's reading (a threshold per micro-batch) is another loss
    local = losses.step_totals([mask[s, :w] for s, w in parts])
    acc_local = sum(
        float(
            losses.objective(
                logp[s, :w],
                old[s, :w],
                adv[s],
                mask[s, :w],
                entropy=entropy[s, :w],
                totals=local,
                **kw,
            ).loss
        )
        for s, w in parts
    )
    assert acc_local != pytest.approx(float(full.loss.detach()), abs=1e-6)


def test_top_entropy_mask_hand_values():
    # 4 valid tokens with entropies 0.1, 0.4, 0.2, 0.3; ρ = 0.5 -> threshold = the 0.5-quantile
    # (linear) = 0.25: tokens 2 and 4 (0.4, 0.3) keep their loss, the normaliser stays 4
    logp = _t([[-1.0, -1.0], [-1.0, -1.0]])
    entropy = _t([[0.1, 0.4], [0.2, 0.3]])
    out = losses.objective(
        logp, logp, _t([1.0, 1.0]), torch.ones(2, 2), surrogate="reinforce",
        aggregation="token_mean", entropy=entropy, top_entropy_quantile=0.5,
    )  # fmt: skip
    torch.testing.assert_close(out.per_token, _t([[0.0, 1.0], [0.0, 1.0]]))
    assert float(out.loss) == pytest.approx(0.5)  # (1 + 1)/4
    assert losses.entropy_threshold(entropy, torch.ones(2, 2), 0.5) == pytest.approx(0.25)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("sapo", {"tau_pos": 0.0}, "positive temperature"),
        ("sapo", {"level": "prompt"}, "valid levels: token, sequence"),
        ("vespo", {"k_pos": -1.0}, "finite number >= 0"),
        ("gmpo", {"eps_low": -0.1}, "clip bounds must be >= 0"),
        ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio must be > 0"),
        ("kl_cov", {"kl_cov_ratio": 0.0}, "kl_cov_ratio must be > 0"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef must be >= 0"),
        ("dppo_tv", {"delta_low": -0.1}, "divergence threshold"),
        ("dppo_kl", {"clip_ratio_c": 0.0}, "truncation"),
        ("dro", {}, "DRO needs beta > 0"),
        (
            "clip_cov",
            {"selected": torch.zeros(3, 3, dtype=torch.bool)},
            r"selected must be \[N, T\]",
        ),
        ("sapo", {"eps_low": 0.2}, "unexpected keyword"),
    ],
)
def test_bad_parameters_are_clear_errors(name, params, message):
    with pytest.raises(ValueError, match=message):
        losses.surrogate(name, torch.zeros(2, 3), None, torch.zeros(2), torch.ones(2, 3), **params)


def test_objective_errors_name_the_choices():
    args = (torch.zeros(2, 3), None, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(
        ValueError, match="valid corrections: ratio, sequence_ratio, straight_through"
    ):
        losses.objective(*args, ref_logp=torch.zeros(2, 3), beta=0.1, kl_correction="is")
    with pytest.raises(ValueError, match="needs entropy"):
        losses.objective(*args, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        losses.objective(*args, entropy=torch.zeros(2, 3), top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match=r"valid aggregations: .*token_sum"):
        losses.aggregate("sum", torch.zeros(2, 3), torch.ones(2, 3))
