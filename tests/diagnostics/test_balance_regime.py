"""Reward/KL balance from two backward passes, KL stats, and the normalisation-regime numbers."""

import math

import pytest
import torch

from grouprl import advantages
from grouprl.diagnostics import (
    LOW_SIGMA,
    gradient_orthogonality,
    kl_stats,
    low_sigma_groups,
    per_prompt_gradients,
    reward_kl_balance,
    sigma_stats,
    subset_keys,
)


def test_low_sigma_groups_is_table3s_subset_by_hand():
    # MaxNorm Table 3 caption: updated groups with σ_q < 1e-2. Four groups of 3 (ddof 1):
    #   (0.5, 0.504, 0.5): mean 0.50133, σ = 0.0023094 < 1e-2, updated by GRPO  -> in
    #   (0, 1, 0):         σ = 0.57735, updated                                  -> out (σ)
    #   (1, 1, 1):         σ = 0, collapsed: not updated                         -> out
    #   (0.2, NaN, 0.205): σ of the two valid = 0.0035355 < 1e-2, updated       -> in
    r = torch.tensor(
        [[0.5, 0.504, 0.5], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.2, float("nan"), 0.205]],
        dtype=torch.float64,
    )
    adv = advantages.compute("grpo", r)
    assert LOW_SIGMA == 1e-2
    assert low_sigma_groups(r, adv).tolist() == [True, False, False, True]
    # a looser threshold takes the σ = 0.577 group too; the collapsed one never counts
    assert low_sigma_groups(r, adv, low_sigma=1.0).tolist() == [True, True, False, True]
    # the resolution protocol (δ 1e-2) skips the sub-resolution groups: not updated, not in
    res = advantages.compute("rloo", r, delta_res=1e-2)
    assert low_sigma_groups(r, res).tolist() == [False, False, False, False]
    with pytest.raises(ValueError, match=r"rewards must be \[P, G\]"):
        low_sigma_groups(r[:2], adv)


def test_subset_keys_names_each_r_over_kl():
    m = {"balance/r_over_kl": 3.0, "balance/cosine": 0.5}
    assert subset_keys(m, "low_sigma") == {
        "balance/low_sigma/r_over_kl": 3.0,
        "balance/low_sigma/cosine": 0.5,
    }
    assert set(subset_keys(m, "batch")) == {"balance/batch/r_over_kl", "balance/batch/cosine"}
    with pytest.raises(ValueError, match="valid subsets: low_sigma, batch"):
        subset_keys(m, "all")


def test_balance_linear_losses_hand_derived():
    # reward_loss = a·w, kl_loss = b·x²/2 at x = 1 -> g_R = (a, 0), g_KL = (0, b) per tensor.
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    x = torch.tensor([1.0, 1.0], requires_grad=True)
    a = torch.tensor([3.0, 4.0])  # ‖a‖ = 5
    b = torch.tensor([1.0, 0.0])
    reward = (a * w).sum() + 0 * x.sum()
    kl = (b * x.square() / 2).sum() + (torch.tensor([0.0, 0.5]) * w).sum()
    out = reward_kl_balance(reward, kl, [w, x], beta=0.1)
    # g_R = (3, 4 | 0, 0), g_KL = (0, 0.5 | 1, 0): norms 5 and sqrt(1.25); dot = 2.
    assert out["balance/reward_grad_norm"] == pytest.approx(5.0, abs=1e-12)
    assert out["balance/kl_grad_norm"] == pytest.approx(math.sqrt(1.25), abs=1e-12)
    assert out["balance/r_over_kl"] == pytest.approx(5.0 / (0.1 * math.sqrt(1.25)), abs=1e-9)
    assert out["balance/cosine"] == pytest.approx(2.0 / (5.0 * math.sqrt(1.25)), abs=1e-12)
    # .grad untouched, and the graph is still usable by the optimizer's backward.
    assert w.grad is None
    (reward + 0.1 * kl).backward()
    assert w.grad is not None


def test_balance_is_the_maxnorm_caption_ratio_with_the_unweighted_kl():
    # MaxNorm Table 3 caption: R/KL = ‖g_R‖/(β‖g_KL‖), base β, g_KL of the *unweighted* KL.
    # Two groups, one parameter each, θ = (1, 2); reward branch −(3θ1 + 4θ2): g_R = (−3, −4),
    # ‖g_R‖ = 5. KL of group q: ½θ_q² (reference 0); unweighted branch = mean over groups
    # = (θ1² + θ2²)/4: g_KL = (θ1/2, θ2/2) = (0.5, 1), ‖g_KL‖ = √1.25. β = 0.1:
    # R/KL = 5/(0.1·√1.25) = 44.72; cosine = (−1.5 − 4)/(5·√1.25) = −0.9839.
    theta = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    reward = -(torch.tensor([3.0, 4.0], dtype=torch.float64) * theta).sum()
    kl_per_group = theta.square() / 2
    out = reward_kl_balance(reward, kl_per_group.mean(), [theta], beta=0.1)
    assert out["balance/r_over_kl"] == pytest.approx(5.0 / (0.1 * math.sqrt(1.25)), rel=1e-12)
    assert out["balance/kl_grad_norm"] == pytest.approx(math.sqrt(1.25), rel=1e-12)
    assert out["balance/cosine"] == pytest.approx(-5.5 / (5.0 * math.sqrt(1.25)), rel=1e-12)
    # With a per-group kl_weight (GRPO+β_q-comp: 1/σ_q, here (4, 1)) the *trained* KL branch
    # has gradient (2, 1), ‖·‖ = √5, and would read R/KL = 5/(0.1·√5) = 22.4: not the caption's
    # number. The caller passes the unweighted branch; the function does not un-weight.
    weighted = (torch.tensor([4.0, 1.0], dtype=torch.float64) * kl_per_group).mean()
    w_out = reward_kl_balance(reward, weighted, [theta], beta=0.1)
    assert w_out["balance/r_over_kl"] == pytest.approx(5.0 / (0.1 * math.sqrt(5.0)), rel=1e-12)


def test_balance_without_kl_leaves_ratio_out():
    w = torch.ones(3, requires_grad=True)
    out = reward_kl_balance(w.sum(), (0 * w).sum(), [w], beta=0.04)
    assert "balance/r_over_kl" not in out and out["balance/cosine"] == 0.0
    with pytest.raises(ValueError, match="scalars"):
        reward_kl_balance(w, w.sum(), [w], beta=1.0)


def test_kl_stats_sequence_means():
    kl = torch.tensor([[1.0, 3.0, 9.0], [0.5, 0.5, 7.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # Sequence means: 2.0, 8/3; row 3 empty -> left out. Mean = 7/3;
    # P95 of [2, 8/3] (linear) = 2 + 0.95·(2/3).
    out = kl_stats(kl, mask)
    assert out["kl/mean"] == pytest.approx(7 / 3, abs=1e-12)
    assert out["kl/p95"] == pytest.approx(2 + 0.95 * 2 / 3, abs=1e-12)
    assert out["kl/max"] == pytest.approx(8 / 3, abs=1e-12)
    assert kl_stats(kl, torch.zeros_like(mask)) == {"kl/mean": 0.0, "kl/p95": 0.0, "kl/max": 0.0}


def test_sigma_stats():
    # σ (ddof 1) of [0,1] = sqrt(0.5); of [0,0,1,1]... use groups of 2: [0,1] -> 0.7071,
    # [0,0.5] -> 0.35355; collapsed [1,1] left out. Mean 0.53033, cv = 0.17678/0.53033 = 1/3.
    r = torch.tensor([[0.0, 1.0], [0.0, 0.5], [1.0, 1.0]], dtype=torch.float64)
    s = sigma_stats(r)
    assert s["regime/sigma_mean"] == pytest.approx(0.75 * math.sqrt(0.5), abs=1e-12)
    assert s["regime/sigma_cv"] == pytest.approx(1 / 3, abs=1e-12)
    assert s["regime/live_groups"] == 2.0
    assert sigma_stats(torch.ones(2, 3))["regime/sigma_mean"] == 0.0


def test_gradient_orthogonality():
    assert gradient_orthogonality(torch.eye(4)) == 0.0
    # Rows (1,0), (1,1)/√2·k, (0,0): zero row dropped; |cos| = 1/√2 for the one pair.
    g = torch.tensor([[1.0, 0.0], [3.0, 3.0], [0.0, 0.0]])
    assert gradient_orthogonality(g) == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert gradient_orthogonality(torch.tensor([[1.0, -1.0], [-2.0, 2.0]])) == pytest.approx(1.0)


def test_per_prompt_gradients_full_and_sampled():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    losses = torch.stack([w[0] * 2, w[1] * w[2]])  # grads (2,0,0) and (0,3,2)
    full = per_prompt_gradients(losses, [w], coords=None)
    assert torch.equal(full, torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 2.0]]))
    gen = torch.Generator().manual_seed(0)
    part = per_prompt_gradients(losses, [w], coords=2, generator=gen)
    assert part.shape == (2, 2)
    assert gradient_orthogonality(full) == 0.0
