"""The closed-loop low-variance simulation's pieces against hand-derived answers and properties.

No test reads the simulation's own ``holds`` flags: the calibration's P95/P99 and its fit
are checked on hand-built records whose answers are derived in the comments, the subset
gradients against the softmax score function written out by hand, the world and the training
loop against properties that follow from the definitions.
"""

import math

import pytest
import torch

from grouprl.simulate import low_variance as lv

# ----------------------------------------------------------------------------- calibration math


def _record(u, v, xi, gap) -> lv.JitterRecord:
    t = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    return lv.JitterRecord([t(u)], [t(v)], [t(xi)], [t(gap)])


def test_jitter_tail_on_a_hand_built_batch():
    # Nine credible-gap groups with σ = 5e-3 (1/σ = 200) and one constant-reward group whose
    # prompt has u = 0 (s = lo = 1e-4) and unit-noise std 1, so σ = 1e-4 and 1/σ = 10,000.
    # Ten pooled values, linear interpolation: P95 sits at position 0.95·9 = 8.55 between
    # 200 and 10,000: 200 + 0.55·9,800 = 5,590; P99 at 8.91: 200 + 0.91·9,800 = 9,118.
    rec = _record([0.0], [0.3], [1.0], [5e-3] * 9)
    p95, p99 = lv.jitter_tail(rec, share=0.5, lo=1e-4, eps=0.0)
    assert p95 == pytest.approx(5590.0) and p99 == pytest.approx(9118.0)
    # share 0.3 <= v: the prompt's verifier is exact, the group is collapsed, not updated.
    assert lv.jitter_tail(rec, share=0.3, lo=1e-4, eps=0.0) == pytest.approx((200.0, 200.0))
    # lo = 2e-2: σ >= 1e-2 leaves the low-σ subset; only the gap groups remain.
    assert lv.jitter_tail(rec, share=1.0, lo=2e-2, eps=0.0) == pytest.approx((200.0, 200.0))
    # GRPO's eps: 1/(σ + 1e-6) for the jitter group = 1/(1.01e-4) = 9,900.99...
    p99_eps = lv.jitter_tail(rec, share=1.0, lo=1e-4, eps=1e-6)[1]
    assert p99_eps == pytest.approx(200 + 0.91 * (1 / 1.01e-4 - 200))


def test_fit_jitter_known_answer():
    # J constant-reward groups, u on a uniform grid, v quasi-uniform and independent of u
    # (golden-ratio sequence), unit-noise std 1; K gap groups at σ = 5e-3 (1/σ = 200).
    # Jittered groups have 1/σ = 1/(lo·10^u), log-uniform on [1/(10 lo), 1/lo], all above 200
    # for the answer below. With f their share of the pooled groups, the pooled upper tail
    # is P(1/σ > y) = f·log10(1/(lo·y)), so P95 and P99 satisfy log10(1/(lo·P95)) = 0.05/f
    # and log10(1/(lo·P99)) = 0.01/f: log10(P99/P95) = 0.04/f, i.e.
    #   f = 0.04/log10(3100/980) = 0.07998,  lo = 1/(3100·10^(0.01/f)) = 2.419e-4,
    # and the share of prompts is π = f·K/((1 − f)·J).
    J, K = 20_000, 6_000
    i = torch.arange(J, dtype=torch.float64)
    u = (i + 0.5) / J
    v = torch.remainder(i * (math.sqrt(5) - 1) / 2, 1.0)
    rec = _record(u, v, torch.ones(J), torch.full((K,), 5e-3))
    share, lo = lv.fit_jitter(rec, (980.0, 3100.0), eps=0.0)
    f = 0.04 / math.log10(3100 / 980)
    assert lo == pytest.approx(1 / (3100 * 10 ** (0.01 / f)), rel=0.02)
    assert share == pytest.approx(f * K / ((1 - f) * J), rel=0.02)
    p95, p99 = lv.jitter_tail(rec, share, lo, eps=0.0)
    assert p95 == pytest.approx(980.0, rel=0.01) and p99 == pytest.approx(3100.0, rel=0.01)


def test_fit_jitter_saturates_at_share_one():
    # Only 2 % of the pooled groups can ever be jittered: P95 stays on the gap groups (200),
    # so the fit returns share 1 and still pins P99 = 3100.
    rec = _record([0.5] * 2, [0.0] * 2, [1.0] * 2, [5e-3] * 98)
    share, lo = lv.fit_jitter(rec, (980.0, 3100.0), eps=0.0)
    assert share == 1.0
    assert lv.jitter_tail(rec, share, lo, eps=0.0)[1] == pytest.approx(3100.0, rel=1e-3)


def test_bisect_log_finds_the_crossing_and_stays_in_the_bracket():
    # fn(x) = 1/x is decreasing; fn(x) = 0.25 at x = 4.
    assert lv.bisect_log(lambda x: 1 / x, 0.25, 0.1, 100.0, 50) == pytest.approx(4.0, rel=1e-9)
    # target above fn(lo) = 10: the bracket only moves left, towards lo
    assert lv.bisect_log(lambda x: 1 / x, 50.0, 0.1, 100.0, 50) == pytest.approx(0.1, rel=1e-9)
    with pytest.raises(ValueError, match="0 < lo < hi"):
        lv.bisect_log(lambda x: x, 1.0, 2.0, 1.0, 5)


# ----------------------------------------------------------------------------- subset gradients


def test_subset_gradients_against_the_score_function_by_hand():
    # logits = prior + x W, log π(a) = z_a − logsumexp(z), so ∂ log π_s(a)/∂W = x_s ⊗ (e_a − π_s).
    # Reward branch −mean(A·log π): g_R = −(1/SG) Σ A_si x_s ⊗ (e_a − π_s).
    # k3 = e^(ref − lp) − (ref − lp) − 1, ∂k3/∂lp = 1 − e^(ref − lp): g_KL = (1/SG) Σ (1 −
    # e^(ref − lp)) x_s ⊗ (e_a − π_s). Cardinal branch as the reward branch with A_card.
    gen = torch.Generator().manual_seed(0)
    s, g, d, v = 3, 4, 2, 5
    x = torch.randn(s, d, generator=gen, dtype=torch.float64)
    prior = torch.randn(s, v, generator=gen, dtype=torch.float64)
    w = (0.3 * torch.randn(d, v, generator=gen, dtype=torch.float64)).requires_grad_(True)
    act = torch.randint(v, (s, g), generator=gen)
    adv = torch.randn(s, g, generator=gen, dtype=torch.float64)
    card = torch.randn(s, g, generator=gen, dtype=torch.float64)
    lsm = torch.log_softmax(prior + x @ w, 1)
    lp = lsm.gather(1, act)
    ref = torch.log_softmax(prior, 1).gather(1, act)
    beta = 0.7
    got = lv.subset_gradients(w, lp, ref, adv, card, beta)

    pi = lsm.detach().exp()  # [S, V]
    onehot = torch.nn.functional.one_hot(act, v).double()  # [S, G, V]
    score = onehot - pi[:, None, :]  # [S, G, V]

    def grad(coef):  # (1/SG) Σ coef_si x_s ⊗ score_si  -> [d, V]
        return torch.einsum("sg,sd,sgv->dv", coef, x, score) / (s * g)

    g_r = -grad(adv)
    g_kl = grad(1 - torch.exp(ref - lp.detach()))
    g_c = -grad(card)
    cos = lambda a, b: float((a * b).sum() / (a.norm() * b.norm()))  # noqa: E731
    assert got["r_over_kl"] == pytest.approx(float(g_r.norm() / (beta * g_kl.norm())), rel=1e-10)
    assert got["cos_kl"] == pytest.approx(cos(g_r, g_kl), abs=1e-10)
    assert got["cos_cardinal"] == pytest.approx(cos(g_r, g_c), abs=1e-10)
    # the cardinal cosine of a positive multiple of the cardinal advantages is exactly 1
    same = lv.subset_gradients(w, lp, ref, 16 / 15 * card, card, beta)
    assert same["cos_cardinal"] == pytest.approx(1.0, abs=1e-12)


# ----------------------------------------------------------------------------- world, training
SMALL = lv.LowVarianceConfig(prompts=96, batch=16, steps=12, measure_every=2, prior_scale=8.0)


def test_world_is_what_the_docstring_says():
    cfg = SMALL
    w = lv.make_world(cfg, torch.Generator().manual_seed(1))
    v = cfg.meanings * cfg.forms
    assert w.prior.shape == w.value.shape == (cfg.prompts, v)
    assert (w.correct.sum(1) == cfg.correct * cfg.forms).all()  # top-`correct` meanings
    levels = torch.arange(cfg.credit_levels, dtype=torch.float64) * cfg.credit_step
    assert torch.isin(w.credit, levels).all()
    c_max = cfg.credit_step * (cfg.credit_levels - 1)
    assert torch.equal(w.value, (1 - c_max) * w.correct + w.credit)
    assert float(w.value.min()) >= 0.0 and float(w.value.max()) <= 1.0 + 1e-12
    # the reward depends on the meaning only: every form of a meaning has the same value
    per_form = w.value.reshape(cfg.prompts, cfg.meanings, cfg.forms)
    assert (per_form == per_form[:, :, :1]).all()
    s = lv.jitter_scale(w, 0.4, 1e-4, 10.0)
    on = w.jit_v < 0.4
    assert (s[~on] == 0).all() and (s[on] >= 1e-4).all() and (s[on] <= 1e-3).all()


def test_training_properties():
    cfg = SMALL
    world = lv.make_world(cfg, torch.Generator().manual_seed(2))
    jit = (0.5, 3e-4)
    run = {m: lv.train(m, world, cfg, beta=0.5, jitter=jit, seed=2) for m in lv.METHODS}
    # deterministic given the seed
    again = lv.train("grpo", world, cfg, beta=0.5, jitter=jit, seed=2)
    assert again == run["grpo"]
    # unscaled estimators: scale 1; the Protocol skips every constant-but-jitter group
    for m in ("rloo+protocol", "dr_grpo"):
        assert run[m]["inv P95"] == run[m]["inv P99"] == 1.0
    assert run["grpo"]["jitter-only share"] > 0  # the peaked prior makes such groups
    for m in ("rloo+protocol", "p90+protocol", "maxnorm_rloo", "maxnorm_dr_grpo"):
        assert run[m]["jitter-only share"] == 0.0
        assert run[m]["inv P99"] <= 1 / cfg.delta_res + 1e-9
    # Dr.GRPO *is* the cardinal direction
    assert run["dr_grpo"]["Dir: cos(g_R, g_cardinal)"] == pytest.approx(1.0, abs=1e-12)
    for m, r in run.items():
        assert r["mean KL"] >= 0 and r["KL P95"] >= 0, m
    # With β = 0 the per-group kl_weight of grpo_beta_comp acts on nothing: same run as grpo
    # (R/KL is undefined at β = 0 and reads NaN in both).
    a = lv.train("grpo", world, cfg, beta=0.0, jitter=jit, seed=3)
    b = lv.train("grpo_beta_comp", world, cfg, beta=0.0, jitter=jit, seed=3)
    for key in ("R/KL", "R/KL, all updated groups"):
        assert math.isnan(a.pop(key)) and math.isnan(b.pop(key))
    assert a == b


def test_simulate_with_given_calibration_and_bad_input():
    cfg = {"prompts": 64, "batch": 8, "steps": 6, "measure_every": 2}
    r = lv.simulate(quick=True, beta=0.5, jitter_share=0.5, jitter_lo=3e-4, **cfg)
    assert [row["method"] for row in r.rows] == list(lv.METHODS)
    cal = r.config["calibration"]
    assert cal["beta"] == 0.5 and cal["jitter_share"] == 0.5 and cal["jitter_lo"] == 3e-4
    with pytest.raises(ValueError, match="correct < meanings"):
        lv.make_world(lv.LowVarianceConfig(correct=40), torch.Generator())


def test_cli_beta_flag(tmp_path):
    import json

    from grouprl.cli import main

    assert (
        main(["simulate", "low-variance", "--quick", "--beta", "0.5", "--out", str(tmp_path)]) == 0
    )
    data = json.loads((tmp_path / "low-variance.json").read_text())
    assert data["config"]["calibration"]["beta"] == 0.5
    assert [r["method"] for r in data["rows"]] == list(lv.METHODS)
    with pytest.raises(SystemExit, match="low-variance only"):
        main(["simulate", "acr", "--quick", "--beta", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=">= 0"):
        main(["simulate", "low-variance", "--quick", "--beta", "-1", "--out", str(tmp_path)])
