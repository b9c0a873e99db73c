"""AGPO: probe statistics, clip formula test vectors, controllers and their state."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.control import agpo

# ----------------------------------------------------------------------------- clip formula


def test_clip_epsilon_test_vector_from_algorithms_md():
    # ε_base 0.2, h 1.5, E 0.7, δ_E 0.1, σ̂ 0.4, D 0.2, γ_KL 0.5, |κ| 0.3, ζ 0.2
    # numerator 0.2·1.5·(1 + 0.07) = 0.321; denominator 1 + 0.4 + 0.1 + 0.06 = 1.56
    # ε = 0.321 / 1.56 = 0.205769... -> 0.2058
    eps = agpo.clip_epsilon(
        dispersion=0.4,
        vote_entropy=0.7,
        abs_skew=0.3,
        h=1.5,
        drift=0.2,
        eps_base=0.2,
        delta_e=0.1,
        gamma_kl=0.5,
        zeta=0.2,
    )
    assert eps == pytest.approx(0.321 / 1.56, abs=1e-12)
    assert round(eps, 4) == 0.2058


def test_clip_epsilon_own_vector_two_answers_split():
    # Our vector 1: probe rewards [1, 0, 0, 0] -> σ̂ = 0.5 (ddof 1: mean 0.25, Σdev² = 0.75,
    # /3 = 0.25, √ = 0.5); answers split 50/50 -> E = ln 2 = 0.693147; H/H_ref = 2 -> h = 1.5;
    # D = 0, ζ = 0. ε = 0.2·1.5·(1 + 0.0693147)/(1 + 0.5) = 0.2·1.0693147 = 0.21386294
    eps = agpo.clip_epsilon(
        dispersion=0.5, vote_entropy=math.log(2), abs_skew=2.0, h=1.5, drift=0.0
    )
    assert eps == pytest.approx(0.2 * (1 + 0.1 * math.log(2)), abs=1e-12)
    assert round(eps, 6) == 0.213863


def test_clip_epsilon_own_vector_bounds():
    # Our vector 2 (lower bound): h 0.5, E 0, σ̂ 3, D 2 (γ 0.5 -> 1): 0.2·0.5/(1+3+1) = 0.02
    # -> clipped up to ε_min 0.05.
    assert (
        agpo.clip_epsilon(dispersion=3.0, vote_entropy=0.0, abs_skew=0.0, h=0.5, drift=2.0) == 0.05
    )
    # upper bound: h 1.5, E = ln 8 = 2.0794, δ_E 1: 0.2·1.5·3.0794 = 0.924 -> ε_max 0.4
    assert (
        agpo.clip_epsilon(
            dispersion=0.0, vote_entropy=math.log(8), abs_skew=0.0, h=1.5, drift=0.0, delta_e=1.0
        )
        == 0.4
    )


# ----------------------------------------------------------------------------- probe stats


def test_dispersions_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # std (ddof 1): row 0 -> 0.5; row 1: mean .5, Σdev² = 1, /3 -> √(1/3) = 0.57735; row 2 -> 0
    torch.testing.assert_close(
        agpo.dispersion(r, "std"), torch.tensor([0.5, 1 / math.sqrt(3), 0.0])
    )
    # mad: row 0 median 0, |r - 0| = [1,0,0,0], median 0 -> 0
    #      row 1 median 0.5 (mean of middle), |r - .5| = .5 each -> 1.4826·0.5 = 0.7413
    #      with the AGPO code's lower median: median 0, |r| = [0,0,1,1], lower median 0 -> 0
    torch.testing.assert_close(agpo.dispersion(r, "mad"), torch.tensor([0.0, 0.7413, 0.0]))
    torch.testing.assert_close(
        agpo.dispersion(r, "mad", median="lower"), torch.tensor([0.0, 0.0, 0.0])
    )
    # iqr, linear interpolation on sorted [0,0,0,1]: Q25 at 0.75 -> 0, Q75 at 2.25 -> 0.25
    # -> 0.25/1.349 = 0.185322; row 1 sorted [0,0,1,1]: Q25 0, Q75 1 -> 1/1.349 = 0.741290
    torch.testing.assert_close(
        agpo.dispersion(r, "iqr"), torch.tensor([0.25 / 1.349, 1 / 1.349, 0.0])
    )
    with pytest.raises(ValueError, match="valid dispersions: std, mad, iqr"):
        agpo.dispersion(r, "var")


def test_dispersion_ignores_nan():
    r = torch.tensor([[1.0, math.nan, 0.0, 0.0, 0.0], [math.nan] * 5])
    for mode in ("std", "mad", "iqr"):
        out = agpo.dispersion(r, mode)
        torch.testing.assert_close(out[0], agpo.dispersion(r[:1, [0, 2, 3, 4]], mode)[0])
        assert out[1] == 0.0


def test_dispersion_of_a_broadcast_batch_is_its_copys():
    # one reward per prompt broadcast over its group (stride 0 along the samples): torch's
    # CPU nanmedian of such a view returns values that are not in it; the lower median reads
    # a row-major copy; every group is constant, so its median deviation and IQR are 0
    r = torch.rand(50, 1, generator=torch.Generator().manual_seed(4)).expand(50, 8)
    for mode in ("std", "mad", "iqr"):
        for median in ("lower", "mean_of_middle"):
            got = agpo.dispersion(r, mode, median=median)
            assert torch.equal(got, agpo.dispersion(r.contiguous(), mode, median=median))
            if mode != "std":  # (σ from the rounded mean: a few 1e-8)
                assert torch.equal(got, torch.zeros(50))


def test_skewness_hand_values():
    # [1, 0, 0, 0]: mean .25, deviations .75, -.25 ×3; m2 = .75/4 = .1875,
    # m3 = (.421875 - 3·.015625)/4 = .09375; g1 = m3/m2^1.5 = 1.1547;
    # G1 = √(4·3)/2 · g1 = 1.7320508·1.1547005 = 2.0 exactly
    # AGPO code (Bessel std .5): mean(((x-m)/.5)³) = (3.375 - 3·.125)/4 = .75; ×1.7320508 = 1.299
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0] * 4, [0.0, 1.0, 0, 0]])
    torch.testing.assert_close(agpo.skewness(r)[:3], torch.tensor([2.0, -2.0, 0.0]))
    assert float(agpo.skewness(r, moment_ddof=1)[0]) == pytest.approx(0.75 * math.sqrt(3))
    # clamp at ±10: one 1 among 200 zeros has G1 ≈ 14.1
    big = torch.zeros(1, 200)
    big[0, 0] = 1.0
    assert float(agpo.skewness(big)) == 10.0


def test_skewness_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    r = torch.rand(20, 7, generator=g, dtype=torch.float64) ** 3
    expect = torch.tensor(scipy_stats.skew(r.numpy(), axis=1, bias=False))
    torch.testing.assert_close(agpo.skewness(r), expect, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{3} wait, \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last box, nested braces
        ("reasoning...\n#### 1,234", "1234"),
        ("The Answer is Seven", "the answer is seven"),
        ("x = 3, y = 4.0 so total 8/2", "4"),  # last number, canonical: 8/2 = 4
        ("result -0.50", "-1/2"),
        ("  many   spaces\nhere  ", "many spaces here"),
        ("\\boxed{ABC } end", "abc"),
    ],
)
def test_extract_answer_key(text, key):
    assert agpo.extract_answer_key(text) == key


def test_vote_entropy_hand_values():
    # keys 4, 4, 5, 4 -> p = (3/4, 1/4): E = -(.75 ln .75 + .25 ln .25) = 0.215762 + 0.346574
    texts = ["\\boxed{4}", "#### 4", "the answer is 5", "so 4.0"]
    assert agpo.vote_entropy(texts) == pytest.approx(0.5623351446, abs=1e-9)
    assert agpo.vote_entropy(["a", "b", "c", "d"]) == pytest.approx(math.log(4))
    assert agpo.vote_entropy(["7", "7.0"]) == 0.0
    assert agpo.vote_entropy([]) == 0.0


def test_probe_stats_batch():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    stats = agpo.probe_stats(rewards, ["#### 1", "#### 2", "#### 3", "#### 3"])
    torch.testing.assert_close(stats.vote_entropy, torch.tensor([math.log(2), 0.0]))
    torch.testing.assert_close(stats.dispersion, torch.tensor([math.sqrt(0.5), 0.0]))
    assert set(stats.as_dict()) == {"probe_dispersion", "probe_skewness", "probe_vote_entropy"}
    with pytest.raises(ValueError, match="P\\*G = 4"):
        agpo.probe_stats(rewards, ["x"])


# ----------------------------------------------------------------------------- controllers


def test_temperature_moves_up_above_baseline_and_down_below():
    # U: 0.5 (first: c = 0, τ = 1, EMA = .5)
    #    1.0 (c = (1 - .5)/.5 = 1 -> τ = 1·(1 + .15) = 1.15; EMA = .1 + .45 = .55)
    #    0.0 (c = -.55/.55 = -1 -> τ = 0.85; EMA = .495)
    #    10  (c = 9.505/.495 = 19.2 -> 3.88 -> τ_max 1.5; EMA = 1 + .4455 = 1.4455)
    temp = agpo.AdaptiveTemperature()
    taus = [temp.update(u) for u in (0.5, 1.0, 0.0, 10.0)]
    assert taus == pytest.approx([1.0, 1.15, 0.85, 1.5], abs=1e-6)
    assert temp.ema == pytest.approx(1.4455, abs=1e-12)
    # far below baseline -> τ_min
    assert temp.update(0.0) == pytest.approx(max(0.5, 1 - 0.15), abs=1e-6)


def test_temperature_update_batch_equals_sequential_updates():
    a, b = agpo.AdaptiveTemperature(), agpo.AdaptiveTemperature()
    u = torch.tensor([0.3, 0.9, 0.1, 0.6])
    out = a.update_batch(u)
    expect = torch.tensor([b.update(x) for x in u.tolist()])
    torch.testing.assert_close(out, expect)
    stats = agpo.ProbeStats(
        dispersion=torch.tensor([0.5]),
        skewness=torch.tensor([-2.0]),
        vote_entropy=torch.tensor([0.7]),
    )
    # U = 1·0.5 + 1·0.7 + 0·2 = 1.2; with w_k = 0.5: 2.2
    assert float(a.uncertainty(stats)) == pytest.approx(1.2)
    assert float(agpo.AdaptiveTemperature(w_k=0.5).uncertainty(stats)) == pytest.approx(2.2)


def test_adaptive_clip_entropy_reference_and_drift_ema():
    clip = agpo.AdaptiveClip()
    # first call: H_ref = H = 2 -> h = 2/(2 + 1e-8) ≈ 1; σ̂ .5, E 0: ε = .2/1.5 = 0.133333
    assert clip.update(0.5, 0.0, 0.0, 2.0) == pytest.approx(0.2 / 1.5, abs=1e-8)
    assert clip.entropy_ref == 2.0
    # second: H = 3, H_ref = 2 -> h = 1.5: ε = .2·1.5/1.5 = 0.2; H_ref <- .01·3 + .99·2 = 2.01
    assert clip.update(0.5, 0.0, 0.0, 3.0) == pytest.approx(0.2, abs=1e-8)
    assert clip.entropy_ref == pytest.approx(2.01)
    # drift EMA from 0 with α .1: 0.4 -> .04 -> .076
    assert clip.observe_drift(0.4) == pytest.approx(0.04)
    assert clip.observe_drift(0.4) == pytest.approx(0.076)
    # now D = .076 enters the denominator: H = H_ref -> h ≈ 1; ε = .2/(1 + .5·.076) = 0.192678
    clip.entropy_ref = 2.0
    assert clip.update(0.0, 0.0, 0.0, 2.0) == pytest.approx(0.2 / 1.038, abs=1e-8)


def test_state_dict_round_trip_resumes_identically():
    temp, clip = agpo.AdaptiveTemperature(), agpo.AdaptiveClip()
    for u, h in [(0.4, 1.0), (0.8, 1.3), (0.2, 0.9)]:
        temp.update(u)
        clip.update(u, 0.3, 1.0, h)
        clip.observe_drift(u / 10)
    temp2, clip2 = agpo.AdaptiveTemperature(), agpo.AdaptiveClip()
    temp2.load_state_dict(temp.state_dict())
    clip2.load_state_dict(clip.state_dict())
    for u, h in [(0.5, 1.1), (0.1, 2.0)]:
        assert temp.update(u) == temp2.update(u)
        assert clip.update(u, 0.2, 0.5, h) == clip2.update(u, 0.2, 0.5, h)
    assert temp.state_dict() == temp2.state_dict() and clip.state_dict() == clip2.state_dict()


def test_group_token_mean_and_step_drift():
    # G = 2, P = 2. group 0 tokens (old - new): [.2, .4 | .6, pad] -> mean .4
    # group 1: [-.3, -.1 | -.2, pad] -> mean -.2 -> max(0, .) = 0; drift = (.4 + 0)/2 = .2
    old = torch.zeros(4, 2)
    new = -torch.tensor([[0.2, 0.4], [0.6, 9.0], [-0.3, -0.1], [-0.2, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    assert agpo.step_drift(old, new, mask, group_size=2) == pytest.approx(0.2)
    torch.testing.assert_close(agpo.group_token_mean(old - new, mask, 2), torch.tensor([0.4, -0.2]))
    with pytest.raises(ValueError, match="divisible by group_size=3"):
        agpo.group_token_mean(old, mask, 3)


def test_per_prompt_epsilon_in_ppo_clip():
    # AGPO applies ε per prompt: ppo_clip accepts [N] bounds. ρ = 1.5, A = 1:
    # ε = .2 -> -1.2; ε = .4 -> -1.4; ε = .6 -> -1.5 (not clipped)
    from grouprl import losses

    logp = torch.full((3, 1), math.log(1.5))
    eps = torch.tensor([0.2, 0.4, 0.6])
    per_token, stats = losses.ppo_clip(
        logp, torch.zeros(3, 1), torch.ones(3), torch.ones(3, 1), eps_low=eps, eps_high=eps
    )
    torch.testing.assert_close(per_token[:, 0], torch.tensor([-1.2, -1.4, -1.5]))
    assert stats["clip_frac_high"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="tensor clip bound must be"):
        losses.ppo_clip(logp, None, torch.ones(3), torch.ones(3, 1), eps_low=torch.ones(2))


def test_bad_parameters():
    with pytest.raises(ValueError, match="tau_min <= tau_base"):
        agpo.AdaptiveTemperature(tau_min=1.2)
    with pytest.raises(ValueError, match="eps_min <= eps_base"):
        agpo.AdaptiveClip(eps_base=0.5)
    with pytest.raises(ValueError, match="finite"):
        agpo.AdaptiveTemperature().update(math.nan)


def test_agpo_facade_batch_mean_variant_by_hand():
    # P = 2 probe groups, G = 2. group 0: rewards [1, 0], answers "1", "2" -> σ̂ = √.5 = .70711,
    # E = ln 2 = .69315, U = 1.40026; group 1: [1, 1], answers "3", "3" -> σ̂ 0, E 0, U = 0.
    # temperature: prompt 0 is the first call (c = 0, τ = 1, EMA = 1.40026); prompt 1:
    # c = (0 - 1.40026)/1.40026 = -1 -> τ = .85. Batch-mean variant: τ = mean = .925 for both
    ctl = agpo.AGPO(base_temperature=1.0, per_prompt=False)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    taus, m = ctl.temperature_from_probe(rewards, ["#### 1", "#### 2", "#### 3", "#### 3"])
    torch.testing.assert_close(taus, torch.tensor([0.925, 0.925]))
    assert m["agpo/temperature_min"] == pytest.approx(0.85, abs=1e-6)
    # clip: H = [2, 2]; prompt 0: H_ref = H -> h ≈ 1: ε0 = .2·(1 + .0693147)/(1 + .70711)
    # = .125276; prompt 1: h = 2/2 = 1, ε1 = .2/(1 + 0) = .2 -> mean .162638
    clip = ctl.clip_params(torch.tensor([2.0, 2.0]), 2)
    e0 = 0.2 * (1 + 0.1 * math.log(2)) / (1 + math.sqrt(0.5))
    assert clip["eps_low"] == clip["eps_high"] == pytest.approx((e0 + 0.2) / 2, abs=1e-6)
    # drift: old - new = .5 on every token -> D = .1·.5 = .05
    out = ctl.observe_update(torch.zeros(4, 3), torch.full((4, 3), -0.5), torch.ones(4, 3), 2)
    assert out["agpo/step_drift"] == 0.5 and out["agpo/drift_ema"] == pytest.approx(0.05)
    assert out["agpo/eps_min"] == pytest.approx(e0, abs=1e-6)
    assert out["agpo/eps_max"] == pytest.approx(0.2, abs=1e-6)
    state = ctl.state_dict()
    again = agpo.AGPO()
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(ValueError, match="temperature_from_probe"):
        agpo.AGPO().clip_params(1.0, 2)


def test_agpo_per_prompt_temperature_and_epsilon_by_hand():
    # The AGPO code's default: each prompt at its own τ_t, clipped with its own ε.
    # P = 3, G = 4 (probe rewards, answers):
    #   p0 [1,0,0,0] "1","2","2","2": σ̂ = .5 (ddof 1), E = -(.25 ln .25 + .75 ln .75) = .562335
    #   p1 [1,1,0,0] "1","1","2","2": σ̂ = √(1/3) = .577350, E = ln 2 = .693147
    #   p2 [1,1,1,1] "5" ×4:          σ̂ = 0, E = 0
    # U = σ̂ + E (w = 1, 1, 0): U0 = 1.062335, U1 = 1.270497, U2 = 0.
    # τ (λ .15, α .1): p0 first call -> c 0, τ 1, EMA = U0;
    #   p1: c = (U1 - U0)/(U0 + 1e-8), τ = 1 + .15c, EMA = .1·U1 + .9·U0;
    #   p2: c = (0 - EMA)/(EMA + 1e-8) ≈ -1 -> τ = .85.
    e0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    s1, e1 = math.sqrt(1 / 3), math.log(2)
    u0, u1 = 0.5 + e0, s1 + e1
    ema1 = 0.1 * u1 + 0.9 * u0
    tau1 = 1 + 0.15 * (u1 - u0) / (u0 + 1e-8)
    tau2 = 1 + 0.15 * (0 - ema1) / (ema1 + 1e-8)
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    texts = ["1", "2", "2", "2", "1", "1", "2", "2", "5", "5", "5", "5"]
    ctl = agpo.AGPO()
    taus, m = ctl.temperature_from_probe(rewards, [f"#### {t}" for t in texts])
    torch.testing.assert_close(taus, torch.tensor([1.0, tau1, tau2]))
    assert round(tau1, 6) == 1.029392 and round(tau2, 6) == 0.85
    assert m["agpo/temperature"] == pytest.approx((1.0 + tau1 + tau2) / 3, abs=1e-6)
    # ε with H = [2, 3, 1] (token-mean entropy before the update), D = 0, ζ = 0:
    #   p0: H_ref <- H = 2, h = 2/(2 + 1e-8) ≈ 1: ε = .2·(1 + .1 E0)/(1 + .5)
    #   p1: h = 3/2 = 1.5: ε = .2·1.5·(1 + .1 E1)/(1 + σ̂1); H_ref <- .01·3 + .99·2 = 2.01
    #   p2: h = 1/2.01 = .4975 -> clipped to .5: ε = .2·.5 = .1
    eps = ctl.clip_params(torch.tensor([2.0, 3.0, 1.0]), 4)
    want = torch.tensor(
        [0.2 * (1 + 0.1 * e0) / 1.5, 0.3 * (1 + 0.1 * e1) / (1 + s1), 0.1]
    ).repeat_interleave(4)  # prompt p's ε on its G = 4 rows
    torch.testing.assert_close(eps["eps_low"], want)
    torch.testing.assert_close(eps["eps_high"], want)
    assert ctl.clip.entropy_ref == pytest.approx(0.01 * 1 + 0.99 * 2.01)
    # the per-row ε clips each prompt's rows with its own bound: ρ = 1.3, A = 1 on every row
    from grouprl import losses

    logp = torch.full((12, 1), math.log(1.3))
    per_token, _ = losses.ppo_clip(logp, torch.zeros(12, 1), torch.ones(12), torch.ones(12, 1),
                                   **eps)  # fmt: skip
    # -min(1.3, clip(1.3, 1 ± ε)) = -(1 + ε) where 1 + ε < 1.3, else -1.3
    torch.testing.assert_close(per_token[:, 0], -torch.clamp(1 + want, max=1.3))


def test_agpo_conventions_follow_the_code():
    # skewness over the Bessel std (trainer.py:391-397): [1, 0, 0, 0] -> .75·√3 = 1.299038
    # (the textbook G1 is 2.0); MAD with torch.median's lower middle value (trainer.py:344):
    # [0, 0, 1, 1] -> median 0, |r| = [0, 0, 1, 1], lower median 0 -> MAD 0 (textbook .7413).
    rewards = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1, 1]])
    texts = ["#### 1"] * 8
    code = agpo.AGPO(dispersion_mode="mad")
    code.temperature_from_probe(rewards, texts)
    assert float(code.last_stats.skewness[0]) == pytest.approx(0.75 * math.sqrt(3))
    assert float(code.last_stats.dispersion[1]) == 0.0
    textbook = agpo.AGPO(dispersion_mode="mad", median="mean_of_middle", skew_moment_ddof=0)
    textbook.temperature_from_probe(rewards, texts)
    assert float(textbook.last_stats.skewness[0]) == pytest.approx(2.0)
    assert float(textbook.last_stats.dispersion[1]) == pytest.approx(0.7413)
    assert agpo.AGPO().logprob_temperature == 1.0 and agpo.AGPO().per_prompt


def test_agpo_facade_bad_arguments():
    with pytest.raises(ValueError, match=r"logprob_temperature=1\.0"):
        agpo.AGPO(logprob_temperature=None)
    agpo.AGPO(logprob_temperature=None, per_prompt=False)  # dividing by the batch's one τ: fine
    with pytest.raises(ValueError, match="median"):
        agpo.AGPO(median="upper")
    with pytest.raises(ValueError, match="valid dispersions"):
        agpo.AGPO(dispersion_mode="var")
    ctl = agpo.AGPO()
    ctl.temperature_from_probe(torch.tensor([[1.0, 0.0]]), ["a", "b"])
    with pytest.raises(ValueError, match="policy_entropy must be"):
        ctl.clip_params(torch.ones(3), 2)
