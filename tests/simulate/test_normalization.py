"""The normalisation simulation's math against hand-derived answers and independent references.

Closed forms (derivations in the comments), autograd for the gradients, Monte Carlo for the
reward std, an unbatched reference loop (advantages computed one run at a time) for the
batched runs, and the tabular monotonicity the module docstring states.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import advantages
from grouprl.simulate import get
from grouprl.simulate import normalization as nz

F64 = torch.float64


def test_pools_offsets_and_the_matched_mean_std_by_hand():
    # σ̄ = (√(0.5·0.5) + √(0.02·0.98))/2 = (0.5 + 0.14)/2 = 0.32;
    # √(J(1 − J)) = 0.32 ⇔ J = (1 − √(1 − 4·0.1024))/2 = (1 − √0.5904)/2 = 0.11581...
    j_h = nz.homogeneous_success((0.5, 0.02))
    assert j_h == pytest.approx((1 - math.sqrt(0.5904)) / 2, rel=1e-12)
    assert j_h == pytest.approx(0.1158125, abs=1e-7)
    cfg = nz.NormalizationConfig()
    het, hom = nz.pool_success(cfg, "heterogeneous"), nz.pool_success(cfg, "homogeneous")
    assert het.tolist() == [0.5] * 32 + [0.02] * 32 and hom.tolist() == [j_h] * 64
    assert float(nz.reward_std(het).mean()) == pytest.approx(float(nz.reward_std(hom).mean()))
    # b_{x,0} = log(J(K − 1)/(1 − J)), others 0: π_0 = e^b/(e^b + K − 1) = J.
    b = nz.initial_offsets(torch.tensor([0.02, 0.3, 0.9], dtype=F64), 8)
    assert torch.allclose(torch.softmax(b, -1)[:, 0], torch.tensor([0.02, 0.3, 0.9], dtype=F64))
    with pytest.raises(ValueError, match="valid pools"):
        nz.pool_success(cfg, "mixed")


def test_reward_std_closed_form_and_monte_carlo():
    # binary reward with P(r = 1) = J: Var = J − J² = J(1 − J).
    assert nz.reward_std(torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=F64)).tolist() == pytest.approx(
        [0.0, math.sqrt(0.21), 0.5, 0.0]
    )
    pi = torch.softmax(nz.initial_offsets(torch.tensor([0.3, 0.05], dtype=F64), 6), -1)  # [2, 6]
    n = 200_000
    u = torch.rand(2, n, generator=torch.Generator().manual_seed(0), dtype=F64)
    a = nz.sample_answers(pi, u)  # [2, n]
    freq = torch.stack([torch.bincount(row, minlength=6) for row in a]).double() / n
    assert ((freq - pi).abs() <= 5 * (pi * (1 - pi) / n).sqrt()).all()
    r = (a == 0).double()
    # SE of a sample std of a binary variable: √((μ4 − σ⁴)/(4σ²n)), μ4 = J(1−J)(1 − 3J(1−J)).
    for row in range(2):
        j = float(pi[row, 0])
        var = j * (1 - j)
        se = math.sqrt((var * (1 - 3 * var) - var**2) / (4 * var * n))
        assert float(r[row].std()) == pytest.approx(math.sqrt(var), abs=5 * se)
        assert float(nz.reward_std(pi[row, 0])) == pytest.approx(math.sqrt(var), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 7), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_logit_gradient_is_the_autograd_gradient(k, g, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(3, k, generator=gen, dtype=F64)
    a = torch.randint(0, k, (3, g), generator=gen)
    adv = torch.randn(3, g, generator=gen, dtype=F64)
    zz = z.clone().requires_grad_(True)
    (adv * torch.log_softmax(zz, -1).gather(-1, a)).sum().backward()
    got = nz.logit_gradient(torch.softmax(z, -1), a, adv)
    assert torch.allclose(got, zz.grad, atol=1e-13, rtol=0)


def test_param_gradient_is_the_chain_rule_through_the_features():
    gen = torch.Generator().manual_seed(3)
    s_n, x_n, k_n, d = 2, 4, 3, 5
    cfg = nz.NormalizationConfig(prompts=x_n, answers=k_n, dim=d)
    phi = torch.stack([nz.make_features(cfg, gen) for _ in range(s_n)])  # [S, X, K, d]
    b = torch.randn(x_n, k_n, generator=gen, dtype=F64)
    theta = torch.randn(2, s_n, d, generator=gen, dtype=F64, requires_grad=True)
    a = torch.randint(0, k_n, (2, s_n, x_n, 6), generator=gen)
    adv = torch.randn(2, s_n, x_n, 6, generator=gen, dtype=F64)
    z = b + torch.einsum("sxkd,lsd->lsxk", phi, theta)
    (adv * torch.log_softmax(z, -1).gather(-1, a)).sum().backward()
    g_logit = nz.logit_gradient(torch.softmax(z.detach(), -1), a, adv)  # [L, S, X, K]
    assert torch.allclose(nz.param_gradient(g_logit, phi), theta.grad, atol=1e-12, rtol=0)
    assert nz.param_gradient(g_logit, None).shape == (2, s_n, x_n * k_n)  # tabular: the logits
    # features have norm ≈ 1 like the tabular unit vectors: E‖φ‖² = d · (1/d) = 1
    big = nz.make_features(nz.NormalizationConfig(prompts=50, answers=8, dim=512), gen)
    assert float(big.square().sum(-1).mean()) == pytest.approx(1.0, abs=0.02)


def _expected_update(pi: torch.Tensor, g: int, estimator: str) -> torch.Tensor:
    """E over the K^G groups of (1/G) Σ_i A_i (e_{a_i} − π), A from advantages.compute."""
    k = pi.numel()
    groups = torch.tensor(list(itertools.product(range(k), repeat=g)))  # [K^G, G]
    prob = pi[groups].prod(-1)  # [K^G]
    adv = advantages.compute(estimator, (groups == 0).double()).values  # [K^G, G]
    upd = nz.logit_gradient(pi.expand(len(groups), -1), groups, adv) / g  # [K^G, K]
    return (prob[:, None] * upd).sum(0)


@pytest.mark.parametrize("probs", [(0.2, 0.5, 0.3), (0.7, 0.1, 0.1, 0.1)])
def test_expected_tabular_updates_against_their_closed_forms(probs):
    # J = π_0, ∇_z J = π_0 (e_0 − π). E[(r_i − r̄) ∇log π(a_i)] = E[r_i ∇log π(a_i)]
    #   − (1/G) Σ_j E[r_j ∇log π(a_i)] = ∇J − (1/G)∇J (j ≠ i independent, E[∇log π] = 0),
    # so REINFORCE (dr_grpo) averages (1 − 1/G) ∇J.
    pi = torch.tensor(probs, dtype=F64)
    grad_j = pi[0] * (torch.eye(len(probs), dtype=F64)[0] - pi)
    for g in (2, 3, 4):
        got = _expected_update(pi, g, "dr_grpo")
        assert torch.allclose(got, (1 - 1 / g) * grad_j, atol=1e-14, rtol=0)
    # GRPO at G = 2: only mixed groups move; A = ±(1/2)/(σ + eps), σ (ddof 1) of {0, 1} = 1/√2.
    # The group's mean update is (A/2)(e_c − e_w); summed over both orders (prob. π_0 π_w each)
    # and every wrong w: A π_0 ((1 − π_0) e_0 − Σ_w π_w e_w) = A ∇J, whatever J is.
    a2 = 0.5 / (1 / math.sqrt(2) + 1e-6)
    assert torch.allclose(_expected_update(pi, 2, "grpo"), a2 * grad_j, atol=1e-14, rtol=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["dr_grpo", "batch_std", "grpo"]))
def test_tabular_updates_never_lower_a_prompts_success(seed, estimator):
    # Group-centred advantages sum to 0 per group: an unsampled answer's logit is unchanged,
    # the correct one rises, sampled wrong ones fall -> J_x cannot decrease (module docstring).
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(5, 4, generator=gen, dtype=F64) * 2
    pi = torch.softmax(z, -1)
    a = nz.sample_answers(pi, torch.rand(5, 6, generator=gen, dtype=F64))
    adv = advantages.compute(estimator, (a == 0).double()).values
    lr = float(torch.rand((), generator=gen)) * 1e3
    new = torch.softmax(z + lr * nz.logit_gradient(pi, a, adv), -1)
    assert (new[:, 0] >= pi[:, 0] - 1e-12).all()


@pytest.mark.parametrize("features", ["shared", "tabular"])
def test_identical_pool_keeps_one_policy_for_every_prompt(features):
    cfg = nz.NormalizationConfig(prompts=6, answers=3, features=features, dim=18, batch=3,
                                 group_size=4, lrs=(30.0,), seeds=2, max_steps=8, log_every=1,
                                 target=0.99)  # fmt: skip
    phi = nz.identical_features(None, 2, 6, 3)
    assert phi.shape == (2, 6, 3, 3) and torch.equal(phi[1, 4], torch.eye(3, dtype=F64))
    shared = torch.randn(2, 6, 3, 5, dtype=F64)
    assert torch.equal(nz.identical_features(shared, 2, 6, 3)[:, 5], shared[:, 0])
    out = nz.run_pool_method(cfg, "identical", "grpo")
    # every prompt has the same J at every step: σ_x equal across the pool, CV 0
    assert (
        out["sigma_cv"].abs().max() < 1e-9
        and out["sigma_mean"][:, -1].ne(out["sigma_mean"][:, 0]).any()
    )
    hom = nz.run_pool_method(cfg, "homogeneous", "grpo")
    assert hom["sigma_cv"][:, -1].max() > 1e-3  # separate prompts drift apart


def test_block_features_by_hand_and_prompts_that_share_nothing():
    # φ_{x,a} = e_x ⊗ ψ_a: prompt x's features live in block x only, the same unit rows ψ for
    # every prompt, so a step on prompt 0 leaves every other prompt's logits where they were
    cfg = nz.NormalizationConfig(prompts=3, answers=4, features="blocks", block_dim=2)
    phi = nz.make_features(cfg, torch.Generator().manual_seed(5))  # [X, K, X·m]
    assert phi.shape == (3, 4, 6)
    blocks = phi.view(3, 4, 3, 2)  # [x, a, block, m]
    for x in range(3):
        for y in range(3):
            assert (blocks[x, :, y] == 0).all() == (x != y)
    assert torch.equal(blocks[0, :, 0], blocks[2, :, 2])  # one answer table for all prompts
    assert torch.allclose(blocks[1, :, 1].norm(dim=-1), torch.ones(4, dtype=F64))
    g_logit = torch.zeros(1, 1, 3, 4, dtype=F64)
    g_logit[0, 0, 0] = torch.tensor([1.0, -0.5, -0.25, -0.25], dtype=F64)
    theta = nz.param_gradient(g_logit, phi[None])  # [1, 1, 6]
    z = nz._logits(torch.zeros(3, 4, dtype=F64), phi[None], theta)  # [1, 1, X, K]
    assert z[0, 0, 1:].abs().max() == 0 and z[0, 0, 0].abs().max() > 0
    with pytest.raises(ValueError, match="unknown features"):
        get("normalization")(quick=True, features="block")


def test_exact_importance_weighting_reaches_the_advantages():
    # is_grpo_exact = Dr.GRPO advantages × 1/(X·p_x): after the first step the sampler's p is
    # no longer uniform, so the weighted run departs from an unweighted sigma-sampled dr_grpo run
    cfg = nz.NormalizationConfig(prompts=6, answers=3, dim=18, batch=3, group_size=4,
                                 lrs=(30.0,), seeds=2, max_steps=5, target=0.99)  # fmt: skip
    exact = nz.run_pool_method(cfg, "heterogeneous", "is_grpo_exact")
    nz.METHODS["_plain"] = ("dr_grpo", "sigma")  # the same draws, no importance weight
    try:
        plain = nz.run_pool_method(cfg, "heterogeneous", "_plain")
    finally:
        del nz.METHODS["_plain"]
    # the first step: all σ̂ unseen, p uniform, weight 1, so the first update is the same
    assert torch.allclose(exact["accuracy"][:, 1], plain["accuracy"][:, 1], atol=1e-14)
    assert not torch.allclose(exact["accuracy"][:, -1], plain["accuracy"][:, -1], atol=1e-9)


def test_first_crossing_and_censoring_by_hand():
    acc = torch.tensor([[0.1, 0.5, 0.85, 0.7], [0.1, 0.2, 0.3, 0.4], [0.9, 0.9, 0.9, 0.9]])
    got = nz.first_crossing(acc, 0.8)
    assert got[0] == 2 and math.isnan(float(got[1])) and got[2] == 0
    assert nz.censored(got, 99.0).tolist() == [2.0, 99.0, 0.0]


def test_best_lr_and_paired_gain_by_hand():
    cfg = nz.NormalizationConfig(lrs=(1.0, 2.0), seeds=2, max_steps=10, batch=2, group_size=5)
    nan = math.nan  # budget = 10 · 2 · 5 = 100
    # base: lr 1 -> (40, nan→100) mean 70; lr 2 -> (50, 60) mean 55 -> best lr 2: (50, 60)
    # grpo: lr 1 -> (20, 30) mean 25 (best); lr 2 -> (nan, nan) -> 100
    runs = {
        ("p", "reinforce"): {"rollouts": torch.tensor([40.0, nan, 50.0, 60.0], dtype=F64)},
        ("p", "grpo"): {"rollouts": torch.tensor([20.0, 30.0, nan, nan], dtype=F64)},
    }
    assert nz.best_lr(cfg, runs[("p", "reinforce")]["rollouts"]) == 1
    g = nz.paired_gain(cfg, runs, "p", "grpo")
    d = [math.log(50 / 20), math.log(60 / 30)]
    assert g["log_gain"] == pytest.approx(sum(d) / 2)
    assert g["se"] == pytest.approx(abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2))
    # lr chosen on seed 0 only, evaluated on seed 1: base lr 1 (40 < 50) -> 100; grpo lr 1 -> 30
    held = nz.paired_gain(cfg, runs, "p", "grpo", select=slice(0, 1), evaluate=slice(1, 2))
    assert held["log_gain"] == pytest.approx(math.log(100 / 30)) and held["se"] == 0.0


def _reference_run(cfg, pool, method, phi, lr_index, seed_index, steps):
    """One run, one step at a time, advantages from compute on that run's [P, G] only."""
    from grouprl import sampling

    estimator, sampler_name = nz.METHODS[method]
    b = nz.initial_offsets(nz.pool_success(cfg, pool), cfg.answers)
    gen_p = torch.Generator().manual_seed(
        nz._generators(cfg, 1, cfg.seeds)[seed_index].initial_seed()
    )
    gen_a = torch.Generator().manual_seed(
        nz._generators(cfg, 2, cfg.seeds)[seed_index].initial_seed()
    )
    sampler = sampling.make(sampler_name, cfg.prompts)
    theta = torch.zeros(phi.shape[-1] if phi is not None else cfg.prompts * cfg.answers, dtype=F64)
    accs = []
    for _ in range(steps):
        z = b + (phi[seed_index] @ theta if phi is not None else theta.view_as(b))  # [X, K]
        pi_all = torch.softmax(z, -1)
        accs.append(float(pi_all[:, 0].mean()))
        idx = sampler.sample(cfg.batch, gen_p)
        u = torch.rand(cfg.batch, cfg.group_size, generator=gen_a, dtype=F64)
        a = nz.sample_answers(pi_all[idx], u)
        r = (a == 0).double()
        # is_grpo_exact: the importance weight of this draw, read before observe moves p
        w = sampler.importance_weights(idx) if method in nz.WEIGHTED else None
        adv = advantages.compute(estimator, r, group_weight=w).values
        if sampler_name == "sigma":
            sampler.observe(idx, advantages.group_std(r))
        g = torch.zeros_like(z).index_add_(0, idx, nz.logit_gradient(pi_all[idx], a, adv))
        grad = torch.einsum("xk,xkd->d", g, phi[seed_index]) if phi is not None else g.flatten()
        theta = theta + cfg.lrs[lr_index] / (cfg.batch * cfg.group_size) * grad
    return accs


@pytest.mark.parametrize("features", ["shared", "tabular", "blocks"])
@pytest.mark.parametrize("method", list(nz.METHODS))
def test_batched_runs_equal_an_unbatched_reference_loop(features, method):
    cfg = nz.NormalizationConfig(
        prompts=6, answers=3, features=features, dim=18, batch=3, group_size=4,
        lrs=(30.0, 300.0), seeds=2, max_steps=6, target=0.99,
    )  # fmt: skip
    phi = None
    if features != "tabular":
        phi = torch.stack([nz.make_features(cfg, g) for g in nz._generators(cfg, 0, cfg.seeds)])
    out = nz.run_pool_method(cfg, "heterogeneous", method)
    acc = out["accuracy"]  # [R, T + 1], r = l·S + s
    for li in range(2):
        for si in range(2):
            ref = _reference_run(cfg, "heterogeneous", method, phi, li, si, acc.shape[1])
            assert acc[li * 2 + si].tolist() == pytest.approx(ref, abs=1e-12)
    assert acc[:, -1].ne(acc[:, 0]).any()  # something moved
    if nz.METHODS[method][1] == "uniform":  # uniform draws shared by every lr of a seed
        assert acc[0, 0] == acc[2, 0]


def test_common_random_numbers_pair_the_uniform_methods():
    cfg = nz.NormalizationConfig(prompts=8, answers=3, dim=24, batch=4, lrs=(50.0,), seeds=2,
                                 max_steps=3, target=0.999)  # fmt: skip
    runs = {m: nz.run_pool_method(cfg, "homogeneous", m) for m in ("reinforce", "grpo")}
    # the first step draws the same prompts and answers; the updates differ only by the scale
    # of the advantages, so the sign of the first accuracy change agrees run by run
    d = {m: (o["accuracy"][:, 1] - o["accuracy"][:, 0]) for m, o in runs.items()}
    assert torch.equal(d["reinforce"].sign(), d["grpo"].sign())


def test_simulate_quick_rows_claims_and_bad_input():
    sim = get("normalization")
    res = sim(quick=True)
    assert {(r["pool"], r["method"]) for r in res.rows} == {
        (p, m) for p in ("homogeneous", "heterogeneous") for m in nz.METHODS
    }
    for r in res.rows:
        assert r["best lr"] in res.config["lrs"]
        if r["method"] == "reinforce":
            assert r["gain vs reinforce"] == 1.0 and r["log gain"] == 0.0
    assert [c.name for c in res.claims] == [
        "grpo_beats_reinforce_from_a_heterogeneous_start",
        "no_grpo_gain_from_a_homogeneous_start",
        "grpo_gain_larger_from_a_heterogeneous_start",
    ]
    ide = sim(quick=True, pools=("identical",), methods=("reinforce", "grpo"))
    assert [c.name for c in ide.claims] == ["no_grpo_gain_on_identical_prompts"]
    # identical: every prompt shares the logits, so the grid is divided by P
    assert all(r["best lr"] in [lr / 4 for lr in ide.config["lrs"]] for r in ide.rows)
    assert res.data["heterogeneous/grpo"]["rollouts"].shape == (2, 2)  # [lrs, seeds]
    with pytest.raises(ValueError, match="valid methods"):
        sim(quick=True, methods=("ppo",))
    with pytest.raises(ValueError, match="unknown features"):
        sim(quick=True, features="conv")
    with pytest.raises(ValueError, match="lrs must be"):
        sim(quick=True, lrs=(0.0,))
    with pytest.raises(ValueError, match="batch"):
        sim(quick=True, batch=100)
