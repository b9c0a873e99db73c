"""The prompt-sampler axis: frequencies, the IS-GRPO alignment, running estimates, checkpoints."""

from __future__ import annotations

import io
import math

import pytest
import torch
from scipy import stats

from grouprl import advantages, sampling


def _observed(pool_size: int, sigma: torch.Tensor, **kw) -> sampling.SigmaSampler:
    s = sampling.make("sigma", pool_size, **kw)
    s.observe(torch.arange(pool_size), sigma)  # one visit each: σ̂_x = σ_x exactly
    return s


def test_sigma_sampler_frequencies_follow_max_sigma_floor_chi_square():
    # Known σ_x, two of them below the floor 0.05 (one exactly 0: every visit collapsed).
    sigma = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    s = _observed(8, sigma)
    n = 200_000
    idx = s.sample(n, torch.Generator().manual_seed(0))
    counts = torch.bincount(idx, minlength=8).double()
    w = sigma.clamp_min(0.05)  # max(σ, floor)
    expected = n * w / w.sum()
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue > 0.01
    # The same counts are far from uniform (the test has power), and the zero-σ prompt is drawn.
    assert stats.chisquare(counts.numpy(), torch.full((8,), n / 8.0).numpy()).pvalue < 1e-12
    assert counts[0] > 0
    assert torch.allclose(s.probabilities(), w / w.sum(), rtol=0, atol=1e-15)


def test_uniform_sampler_frequencies_and_distinct_draws():
    u = sampling.make("uniform", 10)
    g = torch.Generator().manual_seed(1)
    draws = [u.sample(10, g) for _ in range(5000)]
    assert all(len(set(d.tolist())) == 10 for d in draws)  # without replacement in a step
    firsts = torch.stack([d[0] for d in draws])
    counts = torch.bincount(firsts, minlength=10).numpy()
    assert stats.chisquare(counts).pvalue > 0.01
    u.observe(torch.tensor([3]), torch.tensor([0.4]))  # records nothing
    assert torch.equal(u.probabilities(), torch.full((10,), 0.1, dtype=torch.float64))


def _tabular_pool():
    """12 prompts, 6 actions each (actions 0, 1 correct), success J_x from 0.01 to 0.99.

    Returns π [K, A], r [K, A], J [K] with J_x = Σ_a π_x(a) r_x(a).
    """
    target = torch.tensor(
        [0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 0.99], dtype=torch.float64
    )
    k, a = len(target), 6
    z = torch.randn(k, a, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = torch.zeros(k, a, dtype=torch.float64)
    r[:, :2] = 1.0
    w = z.exp()
    # shift the correct logits so that Σ_correct π = target exactly
    z[:, :2] += torch.log(target * w[:, 2:].sum(1) / ((1 - target) * w[:, :2].sum(1)))[:, None]
    pi = torch.softmax(z, 1)
    return pi, r, (pi * r).sum(1)


def _cosine(p: torch.Tensor, per_prompt: torch.Tensor, full: torch.Tensor) -> float:
    v = (p[:, None] * per_prompt).reshape(-1)
    f = full.reshape(-1)
    return float(v @ f / (v.norm() * f.norm()))


def test_sigma_sampling_makes_the_expected_grpo_update_parallel_to_the_full_gradient():
    pi, r, j = _tabular_pool()
    k, a = pi.shape
    sigma = (j * (1 - j)).sqrt()  # Bernoulli reward std of each prompt
    # Full gradient of J = (1/K) Σ_x J_x w.r.t. each prompt's logits, closed form:
    # ∂J_x/∂z_x = π_x ⊙ (r_x − J_x).
    full = pi * (r - j[:, None]) / k  # [K, A]
    # GRPO's per-prompt expected update with population mean and std (the large-G limit),
    # written as the score-function expectation Σ_a π(a)·(r(a) − J)/σ·(e_a − π):
    eye = torch.eye(a, dtype=torch.float64)
    score = eye[None, :, :] - pi[:, None, :]  # [K, A(action), A(logit)]
    adv = (r - j[:, None]) / sigma[:, None]  # [K, A]
    u = (pi[:, :, None] * adv[:, :, None] * score).sum(1)  # [K, A]
    s = _observed(k, sigma, sigma_floor=1e-3)
    idx = s.sample(400_000, torch.Generator().manual_seed(1))
    freq = torch.bincount(idx, minlength=k).double() / idx.numel()  # sampling average
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    assert _cosine(freq, u, full) > 0.999
    assert _cosine(uniform, u, full) < 0.98  # 0.974: uniform GRPO re-weights by 1/σ_x
    # The sampler's σ̂ learned from noisy groups of 64 (EMA of the observed std) still aligns.
    learned = sampling.make("sigma", k)
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        i = learned.sample(8, g)
        rewards = (torch.rand(8, 64, generator=g, dtype=torch.float64) < j[i, None]).double()
        learned.observe(i, rewards.std(1))
    assert _cosine(learned.probabilities(), u, full) > 0.99


def _grpo_gain(j: float, g: int) -> float:
    """c_G(J): E[GRPO update of one prompt] = c_G(J)·∇J_x for binary rewards (derivation below).

    By symmetry E[(1/G)Σ_i A_i ∇log π(a_i)] = E[A_1 (e_{a_1} − π)]; A_1 depends on a_1 only
    through r_1, so it is Σ_a π_a (e_a − π) f(r_a) with f(r) = E_{k'}[A_1 | r_1 = r], k' ~
    Bin(G − 1, J) correct among the others; Σ_a π_a (e_a − π) = 0 turns this into
    (f(1) − f(0))·Σ_{a correct} π_a (e_a − π) = (f(1) − f(0))·∇J_x.
    """
    f = {}
    for r1 in (0.0, 1.0):
        total = 0.0
        for kk in range(g):
            pmf = math.comb(g - 1, kk) * j**kk * (1 - j) ** (g - 1 - kk)
            row = torch.tensor([[r1] + [1.0] * kk + [0.0] * (g - 1 - kk)], dtype=torch.float64)
            total += pmf * float(advantages.compute("grpo", row).values[0, 0])
        f[r1] = total
    return f[1.0] - f[0.0]


def _expected_std(j: float, g: int) -> float:
    """E[σ̂] of a group of G Bernoulli(J) rewards (Bessel std), what σ̂_x tracks."""
    return sum(
        math.comb(g, kk) * j**kk * (1 - j) ** (g - kk) * math.sqrt(kk * (g - kk) / (g * (g - 1)))
        for kk in range(g + 1)
    )


def test_finite_groups_small_g_uniform_is_already_aligned_large_g_sigma_wins():
    # docs/advantages.md: the alignment is a large-G statement. With G samples the expected
    # update is c_G(J_x)·∇J_x; collapsed groups make c_G nearly flat in J at small G.
    pi, r, j = _tabular_pool()
    k = len(j)
    full = pi * (r - j[:, None]) / k
    grad = pi * (r - j[:, None])
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    cos = {}
    for g in (4, 64):
        c = torch.tensor([_grpo_gain(float(x), g) for x in j], dtype=torch.float64)
        es = torch.tensor([_expected_std(float(x), g) for x in j], dtype=torch.float64)
        p_sigma = es.clamp_min(sampling.DEFAULT_SIGMA_FLOOR)
        u = c[:, None] * grad
        cos[g] = (_cosine(uniform, u, full), _cosine(p_sigma / p_sigma.sum(), u, full))
    assert cos[4][0] > cos[4][1]  # G = 4: 0.9999 vs 0.975
    assert cos[64][1] > cos[64][0]  # G = 64: 0.9997 vs 0.981
    # c_G at G = 4, J = 0.5 by hand: f(1) = E over k' ~ Bin(3, 1/2) of A_1 with r_1 = 1.
    # k' = 0: [1,0,0,0] mean 1/4, std √(1/4) → A = 0.75/0.5 = 1.5; k' = 1: [1,1,0,0] std √(1/3)
    # → 0.5√3; k' = 2: [1,1,1,0] → 0.25/0.5 = 0.5; k' = 3: collapsed → 0.
    # f(1) = (1·1.5 + 3·0.5√3 + 3·0.5 + 0)/8; f(0) = −f(1) by symmetry at J = 1/2.
    f1 = (1.5 + 1.5 * math.sqrt(3) + 1.5) / 8
    assert _grpo_gain(0.5, 4) == pytest.approx(2 * f1, rel=1e-5)


def test_running_estimate_is_an_ema_with_visited_mean_for_unvisited():
    s = sampling.make("sigma", 4, momentum=0.5, sigma_floor=0.01)
    assert torch.equal(s.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))
    s.observe(torch.tensor([0, 1]), torch.tensor([0.4, 0.2]))
    # first visits set σ̂; unvisited prompts 2, 3 get the visited mean 0.3
    assert torch.allclose(s.weights(), torch.tensor([0.4, 0.2, 0.3, 0.3], dtype=torch.float64))
    # prompt 0 twice in one step, in order: 0.5·0.4 + 0.5·0.2 = 0.3, then 0.5·0.3 + 0.5·0 = 0.15;
    # NaN (no usable std) is skipped and is not a visit
    s.observe(torch.tensor([0, 0, 3]), torch.tensor([0.2, 0.0, float("nan")]))
    assert s.sigma_hat[0].item() == pytest.approx(0.15)
    assert s.visits.tolist() == [3, 1, 0, 0]
    assert torch.allclose(s.weights(), torch.tensor([0.15, 0.2, 0.175, 0.175], dtype=torch.float64))
    st = s.stats()
    assert st["sampler/visited_frac"] == 0.5 and st["sampler/sigma_hat_mean"] == pytest.approx(
        0.175
    )
    assert st["sampler/effective_pool"] <= 4.0
    s0 = sampling.make("sigma", 2, momentum=0.0)  # last visit only
    s0.observe(torch.tensor([1, 1]), torch.tensor([0.4, 0.1]))
    assert s0.sigma_hat[1].item() == pytest.approx(0.1)


def test_state_dict_round_trip_reproduces_the_draws():
    s = sampling.make("sigma", 50, sigma_floor=0.02, momentum=0.3)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        i = s.sample(8, g)
        s.observe(i, torch.rand(8, generator=g, dtype=torch.float64) * 0.5)
    buf = io.BytesIO()
    torch.save({"sampler": s.state_dict(), "gen": g.get_state()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    restored = sampling.load(ckpt["sampler"])
    g2 = torch.Generator()
    g2.set_state(ckpt["gen"])
    assert isinstance(restored, sampling.SigmaSampler)
    assert restored.momentum == 0.3 and restored.sigma_floor == 0.02
    for _ in range(5):  # same draws, and the same state after the same observations
        a, b = s.sample(8, g), restored.sample(8, g2)
        assert torch.equal(a, b)
        s.observe(a, torch.rand(8, generator=g, dtype=torch.float64))
        restored.observe(b, torch.rand(8, generator=g2, dtype=torch.float64))
    assert torch.equal(s.visits, restored.visits) and bool((s.visits == 0).any())
    assert torch.allclose(s.sigma_hat, restored.sigma_hat, rtol=0, atol=0, equal_nan=True)
    u = sampling.load(sampling.make("uniform", 7).state_dict())
    assert isinstance(u, sampling.UniformSampler) and u.pool_size == 7


def test_sampler_errors_say_what_to_do():
    assert sampling.names() == ["uniform", "sigma", "curriculum"]
    with pytest.raises(ValueError, match="valid samplers: uniform, sigma"):
        sampling.make("prioritized", 10)
    with pytest.raises(ValueError, match="accepts"):
        sampling.make("uniform", 10, sigma_floor=0.1)
    with pytest.raises(ValueError, match="positive int"):
        sampling.make("sigma", 0)
    with pytest.raises(ValueError, match="sigma_floor must be > 0"):
        sampling.make("sigma", 5, sigma_floor=0.0)
    with pytest.raises(ValueError, match="momentum"):
        sampling.make("sigma", 5, momentum=1.0)
    with pytest.raises(ValueError, match="distinct prompts"):
        sampling.make("uniform", 5).sample(6, torch.Generator())
    s = sampling.make("sigma", 5)
    with pytest.raises(ValueError, match=r"in \[0, 5\)"):
        s.observe(torch.tensor([5]), torch.tensor([0.1]))
    with pytest.raises(ValueError, match="both be"):
        s.observe(torch.tensor([1, 2]), torch.tensor([0.1]))
    with pytest.raises(ValueError, match=">= 0"):
        s.observe(torch.tensor([1]), torch.tensor([-0.1]))
    with pytest.raises(ValueError, match="same pool size"):
        sampling.make("sigma", 6).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="same sampler"):
        sampling.make("uniform", 5).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="not a sampler state"):
        sampling.load({"name": "x"})


def _gain(estimator: str, j: float, g: int) -> float:
    """c_G(J) of any estimator for binary rewards, by enumeration (as ``_grpo_gain``):
    E[per-prompt update] = (f(1) − f(0))·∇J_x with f(r) = E_{k' ~ Bin(G−1, J)}[A_1 | r_1 = r]."""
    f = {}
    for r1 in (0.0, 1.0):
        total = 0.0
        for kk in range(g):
            pmf = math.comb(g - 1, kk) * j**kk * (1 - j) ** (g - 1 - kk)
            row = torch.tensor([[r1] + [1.0] * kk + [0.0] * (g - 1 - kk)], dtype=torch.float64)
            total += pmf * float(advantages.compute(estimator, row).values[0, 0])
        f[r1] = total
    return f[1.0] - f[0.0]


def _learned_sigma_sampler(j: torch.Tensor, g: int) -> sampling.SigmaSampler:
    """A sigma sampler after 60 noisy steps of 8 prompts × g Bernoulli(J) rewards: its σ̂ is
    wrong in the way a real run's is (EMA of few visits, collapsed groups, floor)."""
    s = sampling.make("sigma", len(j))
    gen = torch.Generator().manual_seed(7)
    for _ in range(60):
        i = s.sample(8, gen)
        rewards = (torch.rand(8, g, generator=gen, dtype=torch.float64) < j[i, None]).double()
        s.observe(i, rewards.std(1))
    return s


@pytest.mark.parametrize("g", [2, 4, 8, 16, 64])
def test_exact_importance_weight_aligns_the_expected_update_at_every_group_size(g):
    # is_grpo_exact: Dr.GRPO's r − r̄ times 1/(|X|·p_x), p_x the sampler's real probability.
    # Expected update Σ_x p_x·w_x·c_G^dr(J_x)·∇J_x with c_G^dr = (G − 1)/G for every J
    # (enumerated here, not assumed): parallel to ∇J whatever σ̂ has learned.
    pi, r, j = _tabular_pool()
    k = len(j)
    full = pi * (r - j[:, None]) / k  # [K, A] ∇J, J = (1/K) Σ_x J_x
    grad = pi * (r - j[:, None])  # [K, A] ∇J_x
    s = _learned_sigma_sampler(j, g)
    p = s.probabilities()  # [K] what the sampler draws with
    w = s.importance_weights(torch.arange(k))  # [K]
    assert torch.allclose(w, 1.0 / (k * p), rtol=0, atol=1e-12)
    c_dr = torch.tensor([_gain("dr_grpo", float(x), g) for x in j], dtype=torch.float64)
    assert torch.allclose(c_dr, torch.full_like(c_dr, (g - 1) / g), atol=1e-12)
    exact = _cosine(p, (w * c_dr)[:, None] * grad, full)
    assert exact == pytest.approx(1.0, abs=1e-12)
    # is_grpo as it was: GRPO's own σ_q normaliser under the same draws; below 1 at small G
    c_grpo = torch.tensor([_gain("grpo", float(x), g) for x in j], dtype=torch.float64)
    approx = _cosine(p, c_grpo[:, None] * grad, full)
    assert approx < exact
    if g <= 8:
        assert approx < 0.999


def test_exact_importance_weight_through_compute_monte_carlo():
    # End to end: draw prompts with the sampler, sample groups of 4 from π_x, advantages from
    # advantages.compute("dr_grpo", r, group_weight=w); the average update is parallel to ∇J
    # (Monte Carlo: > 0.999), while the same draws with GRPO's advantages are not (≈ 0.98).
    pi, r, j = _tabular_pool()
    k, a = pi.shape
    full = (pi * (r - j[:, None]) / k).reshape(-1)
    s = _learned_sigma_sampler(j, 4)
    gen = torch.Generator().manual_seed(3)
    eye = torch.eye(a, dtype=torch.float64)
    tot = {
        "exact": torch.zeros(k, a, dtype=torch.float64),
        "grpo": torch.zeros(k, a, dtype=torch.float64),
    }
    for _ in range(400):
        idx = s.sample(256, gen)  # [P]
        act = torch.multinomial(pi[idx], 4, replacement=True, generator=gen)  # [P, 4]
        rew = r[idx].gather(1, act)  # [P, 4]
        score = eye[act] - pi[idx][:, None, :]  # [P, 4, A] ∇ log π(a) w.r.t. prompt x's logits
        w = s.importance_weights(idx)
        for name, adv in (
            ("exact", advantages.compute("dr_grpo", rew, group_weight=w).values),
            ("grpo", advantages.compute("grpo", rew).values),
        ):
            upd = (adv[:, :, None] * score).mean(1)  # [P, A]
            tot[name].index_add_(0, idx, upd)
    cos = {n: float(v.reshape(-1) @ full / (v.norm() * full.norm())) for n, v in tot.items()}
    assert cos["exact"] > 0.999 and cos["grpo"] < 0.99, cos


def test_importance_weights_uniform_is_one_and_bad_input():
    u = sampling.make("uniform", 5)
    assert torch.equal(
        u.importance_weights(torch.tensor([0, 4])), torch.ones(2, dtype=torch.float64)
    )
    s = _observed(3, torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), sigma_floor=0.01)
    # p = (1, 2, 3)/6 -> 1/(3p) = (2, 1, 2/3)
    assert s.importance_weights(torch.tensor([0, 1, 2])).tolist() == pytest.approx([2, 1, 2 / 3])
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        s.importance_weights(torch.tensor([3]))
    with pytest.raises(ValueError, match="group_weight must be"):
        advantages.compute("dr_grpo", torch.ones(2, 4), group_weight=torch.tensor([1.0, 0.0]))
