"""Each simulation's --quick run shows its paper's qualitative claim; pieces checked by hand."""

import json

import pytest
import torch

from grouprl.cli import main
from grouprl.simulate import SIMULATIONS, get, names, write_result
from grouprl.simulate.categorical import (
    CategoricalConfig,
    initial_logits,
    run_group_size,
    sample_actions,
)
from grouprl.simulate.low_variance import QUICK as LV_QUICK
from grouprl.simulate.low_variance import make_groups
from grouprl.simulate.tailmiss import monte_carlo


def _assert_claims(result, expected):
    got = {c.name: c for c in result.claims}
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].holds, f"{result.name}: claim {name} failed: {got[name].detail}"


@pytest.mark.slow
def test_categorical_quick_claims():
    torch.set_num_threads(1)
    r = SIMULATIONS["categorical"](quick=True)
    _assert_claims(
        r, ["grpo_raises_q_pos_while_forgetting", "focal_keeps_more_m_ret", "largest_n_keeps_m_ret"]
    )
    # Initial Q_pos: (e^5 + 999 e^3) / (e^5 + 999 e^3 + 11800) for the quick world = 0.6314.
    import math

    pos = math.exp(5) + 999 * math.exp(3)
    assert r.rows[0]["Q_pos(0)"] == pytest.approx(pos / (pos + 11_800), abs=1e-12)


def test_categorical_initial_q_pos_full_size():
    # Paper: Q_pos ≈ 0.63 with 128,000 actions, 10,000 correct, anchor 5, correct 3, wrong 0.
    z, reward = initial_logits(CategoricalConfig())
    q = torch.softmax(z, 0)[reward > 0].sum().item()
    assert q == pytest.approx(0.63, abs=0.005) and int((reward > 0).sum()) == 10_000


def test_inverse_cdf_sampling_matches_probabilities():
    pi = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    a = sample_actions(pi, 200_000, torch.Generator().manual_seed(0))
    freq = torch.stack([torch.bincount(row, minlength=4) for row in a]).double() / 200_000
    se = (pi * (1 - pi) / 200_000).sqrt()
    assert ((freq - pi).abs() <= 5 * se + 1e-12).all()
    assert freq[0, 3] == 0 and freq[1, 3] == 1.0  # zero-probability actions never drawn


def test_categorical_zero_lr_is_frozen_and_deterministic():
    cfg = CategoricalConfig(n_actions=500, n_correct=50, steps=5, seeds=1, log_every=1, lr=0.0)
    out = run_group_size(cfg, 16, torch.Generator().manual_seed(1))
    assert torch.allclose(out["m_ret"], torch.ones_like(out["m_ret"]))
    cfg = CategoricalConfig(n_actions=500, n_correct=50, steps=20, seeds=2, log_every=5)
    a = run_group_size(cfg, 16, torch.Generator().manual_seed(3))
    b = run_group_size(cfg, 16, torch.Generator().manual_seed(3))
    assert torch.equal(a["q_pos"], b["q_pos"]) and torch.equal(a["m_ret"], b["m_ret"])


def test_tail_miss_quick_claims_and_mc():
    r = SIMULATIONS["tail-miss"](quick=True)
    _assert_claims(r, ["monte_carlo_within_3_se", "non_monotone_peak"])
    # MC at N=1 is exactly 0 and at μ=0.5, τ=0.05, N=2 close to 0.45.
    mc = monte_carlo(0.5, 0.05, torch.tensor([1, 2]), 100_000, torch.Generator().manual_seed(0))
    assert mc[0] == 0.0 and abs(float(mc[1]) - 0.45) < 5 * (0.45 * 0.55 / 1e5) ** 0.5


def test_low_variance_quick_claims():
    r = SIMULATIONS["low-variance"](quick=True)
    _assert_claims(
        r,
        [
            "grpo_unbounded_tail",
            "maxnorm_bounded",
            "resolution_skips_jitter_keeps_gaps",
            "unscaled_kl_dominated",
        ],
    )


def test_low_variance_groups_are_what_they_claim():
    rewards, kind = make_groups(LV_QUICK, torch.Generator().manual_seed(0))
    spread = rewards.amax(1) - rewards.amin(1)
    assert (spread[kind == 1] < 1e-2).all()  # jitter: one resolution bin
    assert (spread[kind == 2] >= 1e-2).all()  # gap: a credible gap
    assert (spread[kind == 0] == 1.0).all()  # binary: mixed


def test_acr_quick_claims():
    r = SIMULATIONS["acr"](quick=True)
    _assert_claims(
        r,
        [
            "grpo_wastes_groups",
            "avspo_symmetric_cuts_waste",
            "paper_mode_defect",
            "symmetric_learns_more_at_equal_rollouts",
        ],
    )
    by = {row["method"]: row for row in r.rows}
    # Same initial pool for every method.
    assert len({row["accuracy start"] for row in r.rows}) == 1
    # Dynamic sampling takes fewer optimizer steps for the same rollout budget.
    assert by["dynamic_sampling"]["optimizer steps"] < by["grpo"]["optimizer steps"]


def test_registry_and_cli(tmp_path):
    from grouprl.cli.simulate import _CHOICES

    assert names() == ["categorical", "tail-miss", "low-variance", "acr"] == list(_CHOICES)
    with pytest.raises(ValueError, match="valid simulations"):
        get("nope")
    assert main(["simulate", "tail-miss", "--quick", "--out", str(tmp_path), "--strict"]) == 0
    data = json.loads((tmp_path / "tail-miss.json").read_text())
    assert data["name"] == "tail-miss" and all(c["holds"] for c in data["claims"])
    assert (tmp_path / "tail-miss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "tail-miss.html").read_text()


def test_write_result_is_json_safe(tmp_path):
    from grouprl.simulate import Claim, SimResult

    res = SimResult(
        "x",
        "X",
        {"a": (1, 2)},
        [{"v": float("nan")}],
        [Claim("c", True, "d")],
        data={"t": torch.ones(2)},
    )
    paths = write_result(res, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["rows"][0]["v"] is None and data["data"]["t"] == [1.0, 1.0]


def test_sparse_update_equals_dense_formula():
    # Dense reference written out: Δz_i = (η/N)·g·Σ_j r̃_j (1[a_j = i] − π_i), π term included.
    cfg = CategoricalConfig(
        n_actions=300, n_correct=40, steps=6, seeds=1, gammas=(0.0, 1.0), log_every=1, lr=0.7
    )
    n = 5
    out = run_group_size(cfg, n, torch.Generator().manual_seed(11))
    z0, reward = initial_logits(cfg)
    gen = torch.Generator().manual_seed(11)
    z = z0.expand(2, -1).clone()
    pi0 = torch.softmax(z, 1)
    for t in range(cfg.steps):
        pi = torch.softmax(z, 1)
        a = sample_actions(torch.exp(z), n, gen)
        for row, gamma in enumerate((0.0, 1.0)):
            r = reward[a[row]]
            rt = r - r.mean()
            g = (1 - (r.mean().item() + 1) / 2) ** gamma
            dz = torch.zeros(cfg.n_actions, dtype=torch.float64)
            for j in range(n):
                onehot = torch.zeros(cfg.n_actions, dtype=torch.float64)
                onehot[a[row, j]] = 1.0
                dz += rt[j] * (onehot - pi[row])
            z[row] += cfg.lr / n * g * dz
        pi_t = torch.softmax(z, 1)
        m_ret = 1 - (pi0[:, :40] - pi_t[:, :40]).clamp_min(0).sum(1) / pi0[:, :40].sum(1)
        assert torch.allclose(out["q_pos"][:, t + 1], pi_t[:, :40].sum(1), atol=1e-12, rtol=0)
        assert torch.allclose(out["m_ret"][:, t + 1], m_ret, atol=1e-12, rtol=0)
