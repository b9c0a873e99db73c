"""Hand-derived values for every estimator and transform; the derivations are in comments."""

import math

import inputs
import pytest
import torch

from grouprl import advantages

# One group r = [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
# Bessel variance (0.75² + 3·0.25²)/3 = 0.75/3 = 0.25, so σ = 0.5.
G1 = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
# A second group r = [1, 1, 0, 0]: mean 0.5, Bessel σ = sqrt(4·0.25/3) = sqrt(1/3) = 0.577350.
B2 = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)


def adv(name, rewards, **kw):
    return advantages.compute(name, rewards, **kw).values


def test_grpo():
    # (r - 0.25) / (0.5 + 1e-6)
    a = adv("grpo", G1)
    assert a[0, 0].item() == pytest.approx(0.75 / 0.500001, abs=1e-12)
    assert a[0, 1].item() == pytest.approx(-0.25 / 0.500001, abs=1e-12)
    # TRL's eps 1e-4 is a named parameter
    assert adv("grpo", G1, eps=1e-4)[0, 0].item() == pytest.approx(0.75 / 0.5001, abs=1e-12)


def test_grpo_ddof0():
    # ddof=0: variance 0.75/4 = 0.1875, σ = 0.4330127; 0.75/σ = sqrt(3) = 1.7320508
    a = adv("grpo", G1, ddof=0, eps=1e-12)
    assert a[0, 0].item() == pytest.approx(math.sqrt(3), abs=1e-9)
    assert a[0, 1].item() == pytest.approx(-math.sqrt(3) / 3, abs=1e-9)


def test_dr_grpo():
    # r - mean, no division
    assert adv("dr_grpo", G1)[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-12)


def test_rloo():
    # 1 - mean(0,0,0) = 1;  0 - mean(1,0,0) = -1/3   (= 4/3 · (r - 0.25))
    assert adv("rloo", G1)[0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)


def test_maxnorm_rloo_and_dr_grpo():
    # u = [1, -1/3, ...]; s = max(0.01, 1) = 1  -> A = u
    assert adv("maxnorm_rloo", G1)[0].tolist() == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12
    )
    # u = [0.75, -0.25, ...]; s = 0.75 -> [1, -1/3, ...]
    assert adv("maxnorm_dr_grpo", G1)[0].tolist() == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12
    )
    # a tiny credible gap: r = [0.02, 0, 0, 0] -> u = [0.02, -0.02/3]; s = max(0.01, 0.02) = 0.02
    tiny = torch.tensor([[0.02, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert adv("maxnorm_rloo", tiny)[0].tolist() == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12
    )
    # gap below the floor: r = [0.004, 0, 0, 0] -> u = [0.004, -0.004/3]; s = tau_res = 0.01
    sub = torch.tensor([[0.004, 0.0, 0.0, 0.0]], dtype=torch.float64)
    out = advantages.compute("maxnorm_rloo", sub)
    assert out.values[0].tolist() == pytest.approx([0.4, -0.4 / 3, -0.4 / 3, -0.4 / 3], abs=1e-12)
    assert out.scale.item() == pytest.approx(0.01)
    assert out.kl_weight.item() == 1.0  # KL is not divided by s_q


def test_p90():
    # |u| sorted = [1/3, 1/3, 1/3, 1]; linear quantile at 0.9·(4-1) = 2.7:
    # 1/3 + 0.7·(1 - 1/3) = 0.8 -> A = [1.25, -0.416667, ...]
    a = adv("p90", G1)[0].tolist()
    assert a == pytest.approx([1.25, -1 / 3 / 0.8, -1 / 3 / 0.8, -1 / 3 / 0.8], abs=1e-12)
    # quantile 1 is the largest |u| = 1 (MaxNorm-RLOO's card): [1, -1/3, -1/3, -1/3];
    # quantile 0 is refused (the range is (0, 1])
    # tau_res_bound_frac: the share of live groups whose card sits at the floor tau_res = 0.01:
    # [0.004, 0, 0, 0] (card 0.004·4/3 < 0.01) of it and [1, 0, 0, 0]; [1, 1, 1, 1] is collapsed
    r = torch.tensor([[0.004, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0] * 4], dtype=torch.float64)
    for name in ("maxnorm_rloo", "maxnorm_dr_grpo", "p90"):
        assert advantages.compute(name, r).stats["tau_res_bound_frac"] == 0.5
        assert advantages.compute(name, r[::2]).stats["tau_res_bound_frac"] == 1.0  # 1 of 1
    top = adv("p90", G1, quantile=1.0)[0].tolist()
    assert top == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)
    with pytest.raises(ValueError, match=r"quantile must be in \(0, 1\], got 0.0"):
        adv("p90", G1, quantile=0.0)


def test_gopo():
    # rank(1) = 3 below + (1 equal + 1)/2 = 4; rank(0) = 0 + (3 + 1)/2 = 2;
    # centred by (n+1)/2 = 2.5 and divided by (n-1)/2 = 1.5: [1, -1/3, -1/3, -1/3]
    assert adv("gopo", G1)[0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)
    # distinct rewards 0.1 < 0.5 < 0.9: ranks 1, 2, 3 -> [-1, 0, 1] whatever the gaps
    r = torch.tensor([[0.5, 0.9, 0.1]], dtype=torch.float64)
    assert adv("gopo", r)[0].tolist() == pytest.approx([0.0, 1.0, -1.0], abs=1e-12)


def test_gopo_of_a_pair_a_nan_and_its_collapse_rule():
    # n = 2: ranks 1, 2 centred by 1.5 and divided by (n − 1)/2 = 0.5: [−1, +1]
    pair = torch.tensor([[0.5, 0.9]], dtype=torch.float64)
    assert adv("gopo", pair)[0].tolist() == [-1.0, 1.0]
    # a NaN leaves the group: the valid 0.5 < 0.9 and 0.1 rank as n = 3 ([0, 1, −1]), the NaN
    # sample gets 0
    r = torch.tensor([[0.5, math.nan, 0.9, 0.1]], dtype=torch.float64)
    assert adv("gopo", r)[0].tolist() == [0.0, 0.0, 1.0, -1.0]
    # collapse rule: [1, 0]: σ = 0.5 with ddof 0 (< tau = 0.55: collapsed, 0), 0.707 with ddof 1 (kept)
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert adv("gopo", z, tau=0.55)[0].tolist() == [1.0, -1.0]
    assert adv("gopo", z, tau=0.55, ddof=0)[0].tolist() == [0.0, 0.0]


def test_batch_std():
    # 8 rewards, three 1s and five 0s: mean 3/8, Bessel var (3·(5/8)² + 5·(3/8)²)/7 = 120/448,
    # σ_B = 0.5175492; group 1: 0.75/σ_B = 1.4491377, group 2: ±0.5/σ_B = ±0.9660918
    a = adv("batch_std", B2, eps=0.0)
    sb = math.sqrt(120 / 448)
    assert a[0].tolist() == pytest.approx([0.75 / sb] + [-0.25 / sb] * 3, abs=1e-12)
    assert a[1].tolist() == pytest.approx([0.5 / sb] * 2 + [-0.5 / sb] * 2, abs=1e-12)


def test_reinforce_pp():
    # u = [.75, -.25, -.25, -.25, .5, .5, -.5, -.5]: batch mean 0, Bessel var 1.75/7 = 0.25,
    # std 0.5 -> A = 2u
    a = adv("reinforce_pp", B2, eps=0.0)
    assert a.reshape(-1).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 1, 1, -1, -1], abs=1e-12)


def test_sigma_weighted_grpo():
    # σ1 = 0.5, σ2 = sqrt(1/3); σ̄ = (0.5 + 0.5773503)/2 = 0.5386751. With eps -> 0 the
    # advantage is (r - r̄_q)/σ̄: group 1 0.75/σ̄ = 1.3923048, group 2 0.5/σ̄ = 0.9282032
    a = adv("sigma_weighted_grpo", B2, eps=1e-12)
    sbar = (0.5 + math.sqrt(1 / 3)) / 2
    assert a[0].tolist() == pytest.approx([0.75 / sbar] + [-0.25 / sbar] * 3, abs=1e-9)
    assert a[1].tolist() == pytest.approx([0.5 / sbar] * 2 + [-0.5 / sbar] * 2, abs=1e-9)


def test_sigma_weighted_grpo_scale_and_sigma_bar_beside_a_collapsed_group():
    # [1, 1] is collapsed (σ 0), [1, 0] has σ = √0.5 = σ̄ (the mean over live groups), so its
    # weight is 1: scale = (σ + eps)/1; the collapsed group's scale is σ + eps = eps
    r = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    out = advantages.compute("sigma_weighted_grpo", r)
    s = math.sqrt(0.5)
    assert out.scale.tolist() == pytest.approx([1e-6, s + 1e-6], rel=1e-12)
    assert out.stats["sigma_bar"] == pytest.approx(s, rel=1e-12)
    assert out.values[1].tolist() == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6)])


@pytest.mark.parametrize(
    "name",
    [
        "grpo",
        "dr_grpo",
        "rloo",
        "batch_std",
        "grpo_beta_comp",
        "sigma_weighted_grpo",
        "maxnorm_rloo",
        "maxnorm_dr_grpo",
        "p90",
    ],
)
def test_the_collapse_rule_reads_ddof_and_tau(name):
    # [1, 0]: σ = 0.5 with ddof 0 (< tau = 0.55: collapsed, every advantage 0), 0.707 with
    # the default ddof 1 (kept: |A| is 0.707, 0.5, 1, 0.707, 0.707, 0.707, then 1 for the three
    # MaxNorm-scaled ones; gopo: its own test)
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert adv(name, r, tau=0.55, ddof=0).abs().sum().item() == 0.0
    assert adv(name, r, tau=0.55).abs().min().item() > 0.4


@pytest.mark.parametrize(
    "name, kw",
    [
        ("opo", {"lengths": torch.tensor([[1, 1]])}),
        ("gdpo", {}),
    ],
)
def test_the_collapse_rule_of_opo_and_gdpo_reads_ddof(name, kw):
    # opo on [1, 0]: σ = 0.5 at ddof 0 (< tau 0.55: 0), 0.707 at ddof 1 (kept). gdpo whitens
    # GDPO's normalised sum ±a, a = 0.5/(√0.5 + 1e-4) ≈ 0.7070: σ = a at ddof 0 (< 0.8: 0),
    # a·√2 at ddof 1 (kept)
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    tau = 0.55 if name == "opo" else 0.8
    assert adv(name, r, tau=tau, ddof=0, **kw).abs().sum().item() == 0.0
    assert adv(name, r, tau=tau, **kw).abs().min().item() > 0.4


def test_the_statistics_of_remax_and_flash_reinforce_read_ddof_and_the_valid_count():
    # remax: [1, 0] is collapsed at ddof 0 (σ 0.5 < tau 0.55), not at ddof 1 (only reported)
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    base = torch.tensor([0.5], dtype=torch.float64)
    frac = [
        advantages.compute("remax", r, baseline=base, tau=0.55, ddof=d).stats["collapsed_frac"]
        for d in (0, 1)
    ]
    assert frac == [1.0, 0.0]
    # flash_reinforce: one valid reward in the batch: its batch mean is that reward
    one = torch.tensor([[0.8, math.nan]], dtype=torch.float64)
    assert advantages.compute("flash_reinforce", one).stats["batch_mean"] == 0.8


def test_whiten_by_hand_with_its_defaults():
    # (x − μ)/(σ + 1e-6) over every entry: μ = 2, σ (ddof 1) = √2 (eps_mode "std", verl's)
    x = torch.tensor([1.0, 3.0], dtype=torch.float64)
    out, mu, s = advantages.global_norm.whiten(x, None)
    want = 1 / (math.sqrt(2) + 1e-6)
    assert out.tolist() == pytest.approx([-want, want], rel=1e-12)
    assert (mu.item(), s.item()) == (2.0, pytest.approx(math.sqrt(2) + 1e-6, rel=1e-12))


def test_batch_std_reads_ddof():
    # ddof 0: σ_q = 0.5 (kept at the default tau) and σ_batch = 0.5: ±0.5/(0.5 + 1e-6)
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    want = 0.5 / (0.5 + 1e-6)
    assert adv("batch_std", r, ddof=0)[0].tolist() == pytest.approx([want, -want], rel=1e-12)


def test_grpo_beta_comp():
    # same advantages as GRPO; kl_weight = 1/(σ_q + eps): 1/0.5 = 2 and 1/0.5773503 = 1.7320508
    out = advantages.compute("grpo_beta_comp", B2, eps=0.0)
    assert out.kl_weight.tolist() == pytest.approx([2.0, math.sqrt(3)], abs=1e-12)
    assert torch.equal(out.values, advantages.compute("grpo", B2, eps=0.0).values)
    # a collapsed group keeps kl_weight 1
    flat = torch.tensor([[1.0, 1.0, 1.0]])
    assert advantages.compute("grpo_beta_comp", flat).kl_weight.item() == 1.0


def test_fgrpo_worked_example():
    # F-GRPO: N = 8, 2 correct. mean 0.25, Bessel σ = sqrt(8·0.25·0.75/7) = 0.4629100.
    # GRPO: A+ = 0.75/σ = 1.620185, A- = -0.25/σ = -0.540062 (the paper's 1.620 / -0.540).
    # The focal weight (1 - 0.25)^0.5 = 0.8660254 then scales both: 1.403122 / -0.467707.
    r = torch.tensor([[1.0, 1.0, 0, 0, 0, 0, 0, 0]])
    base = adv("grpo", r)
    assert base[0, 0].item() == pytest.approx(1.620, abs=5e-4)
    assert base[0, 2].item() == pytest.approx(-0.540, abs=5e-4)
    focal = adv("grpo", r, focal_gamma=0.5)
    assert focal[0, 0].item() == pytest.approx(1.620185 * math.sqrt(0.75), abs=1e-5)
    assert focal[0, 2].item() == pytest.approx(-0.540062 * math.sqrt(0.75), abs=1e-5)


def test_focal_mu_reads_the_verifier_not_the_shaped_rewards():
    # F-GRPO eq. 11: μ̂ = X/N. A group of 4 with 2 correct, whose 2 wrong rollouts were also
    # overlong and got DAPO's soft penalty −0.5: shaped rewards (1, 1, −0.5, −0.5).
    # From the verifier: μ̂ = 2/4 -> g = (1 − 0.5)^1 = 0.5.
    # From the shaped mean (0.25, clipped to [0, 1]) the old code took g = 0.75 instead.
    raw = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    shaped = torch.tensor([[1.0, 1.0, -0.5, -0.5]], dtype=torch.float64)
    base = advantages.compute("grpo", shaped).values  # the estimator reads the shaped rewards
    out = advantages.compute("grpo", shaped, focal_gamma=1.0, verifier_rewards=raw)
    assert out.stats["focal/mean_weight"] == pytest.approx(0.5)
    assert torch.allclose(out.values, 0.5 * base, atol=1e-12)
    # no verifier_rewards: μ̂ from the rewards given, as before
    old = advantages.compute("grpo", shaped, focal_gamma=1.0)
    assert old.stats["focal/mean_weight"] == pytest.approx(0.75)
    # NaN (unscorable) in the verifier's rewards counts out of N: 1 correct of 3 scored
    raw_nan = torch.tensor([[1.0, float("nan"), 0.0, 0.0]], dtype=torch.float64)
    shaped_nan = torch.tensor([[1.0, float("nan"), -0.5, 0.0]], dtype=torch.float64)
    w = advantages.compute("grpo", shaped_nan, focal_gamma=1.0, verifier_rewards=raw_nan)
    assert w.stats["focal/mean_weight"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="verifier_rewards must have the rewards' shape"):
        advantages.compute("grpo", shaped, focal_gamma=1.0, verifier_rewards=raw[:, :3])


def _app_n_integral(gamma: float, power: float, n: int = 4000) -> float:
    """∫(1 − μ)^γ w(μ) dμ / ∫ w(μ) dμ with w = (μ(1 − μ))^power, by Simpson's rule on
    μ = sin²θ (smooth on [0, π/2], so the square-root endpoints cost no accuracy)."""
    h = (math.pi / 2) / n

    def f(theta: float, g: float) -> float:
        mu = math.sin(theta) ** 2
        jac = 2 * math.sin(theta) * math.cos(theta)
        return (1 - mu) ** g * (mu * (1 - mu)) ** power * jac

    def simpson(g: float) -> float:
        total = f(0, g) + f(math.pi / 2, g)
        total += sum((4 if i % 2 else 2) * f(i * h, g) for i in range(1, n))
        return total * h / 3

    return simpson(gamma) / simpson(0.0)


def test_focal_mean_weight_closed_form_against_integration():
    # F-GRPO App. N: m_γ = (4/√π)Γ(γ + 3/2)/Γ(γ + 3); by hand m_0 = (4/√π)(√π/2)/2 = 1,
    # m_1 = (4/√π)(3√π/4)/6 = 1/2, m_0.5 = (4/√π)·1/Γ(3.5) = (4/√π)/(15√π/8) = 32/(15π).
    m = advantages.focal_mean_weight
    assert m(0.0) == pytest.approx(1.0, abs=1e-15)
    assert m(1.0) == pytest.approx(0.5, abs=1e-15)
    assert m(0.5) == pytest.approx(32 / (15 * math.pi), abs=1e-15)
    assert round(m(0.5), 3) == 0.679  # the paper's 6.8e-7 = 0.679 × 1e-6 (§5.6)
    # independent: the weighted average over μ ~ U(0, 1) with the weight √(μ(1 − μ))
    for g in (0.25, 0.5, 1.0, 2.0, 3.7):
        assert m(g) == pytest.approx(_app_n_integral(g, 0.5), abs=1e-10)
    # the weight μ(1 − μ) the App. N text names gives 0.686 at γ = 0.5, not the paper's 0.679
    assert _app_n_integral(0.5, 1.0) == pytest.approx(0.6857, abs=1e-4)
    with pytest.raises(ValueError, match="focal_gamma must be a finite number >= 0"):
        m(-0.5)


def test_focal_reward_range():
    # rewards in [-1, 1]: mean of [1, -1, -1, -1] = -0.5 -> mu = (−0.5 + 1)/2 = 0.25 -> g = 0.75^γ
    r = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    g = advantages.focal_weight(r, ~torch.isnan(r), 1.0, (-1.0, 1.0))
    assert g.item() == pytest.approx(0.75)


def test_resolution_bins_and_skips():
    # [0, 0.001, 0.5, 0.503]: gaps 0.001 | 0.499 | 0.003 -> bins {0, .001} and {.5, .503},
    # replaced by their means 0.0005 and 0.5015; the group mean is unchanged.
    r = torch.tensor([[0.5, 0.0, 0.503, 0.001], [0.3, 0.305, 0.309, 0.3]], dtype=torch.float64)
    binned, keep = advantages.resolution(r, ~torch.isnan(r), 1e-2)
    assert binned[0].tolist() == pytest.approx([0.5015, 0.0005, 0.5015, 0.0005], abs=1e-12)
    # second group: single linkage keeps the chain 0.3 .. 0.309 in one bin -> skipped
    assert keep.tolist() == [True, False]
    out = advantages.compute("maxnorm_rloo", r, delta_res=1e-2)
    assert (out.values[1] == 0).all() and out.stats["resolution/skipped_frac"] == 0.5
    # after binning group 0 is two-valued: u = ±0.501 · 4/3 ... -> MaxNorm gives ±1
    assert out.values[0].tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-12)


def test_collapsed_and_singleton_groups_are_exactly_zero():
    r = torch.tensor([[0.7, 0.7, 0.7], [1.0, math.nan, math.nan], [math.nan] * 3])
    for name in advantages.names():
        if name in ("reinforce_pp_global", "flash_reinforce"):
            continue  # no group baseline: their own tests (test_peer_methods.py)
        out = inputs.compute(name, r)
        assert (out.values == 0).all(), name
        assert not out.updated.any(), name
