"""Hand-derived values for the peers' methods; each derivation is in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages
from grouprl.advantages import combine, tokens
from grouprl.control import AdaptiveKLController, make_kl_controller

D = torch.float64


def same(got: torch.Tensor, want) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=1e-9, rtol=1e-9)


R = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=D)  # group 2 is collapsed
L = torch.tensor([[1, 3], [2, 2]])  # completion lengths


def test_reinforce_pp_global_sample_and_token_weighted():
    # samples 1, 0, 1, 1: mean 0.75; Bessel var (3·0.0625 + 0.5625)/3 = 0.25 -> σ = 0.5
    a = advantages.compute("reinforce_pp_global", R).values
    s = 0.5 + 1e-6
    assert a.reshape(-1).tolist() == pytest.approx([0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s])
    # tokens: weights 1, 3, 2, 2 (8 tokens): mean = (1 + 2 + 2)/8 = 5/8;
    # Σw(x − μ)² = 1·(3/8)² + 3·(5/8)² + 4·(3/8)² = 120/64; /7 -> var = 0.267857;
    # verl's s = sqrt(var + 1e-8)
    t = advantages.compute(
        "reinforce_pp_global", R, lengths=L, weighting="token", eps_mode="var", eps=1e-8
    ).values
    s = math.sqrt(120 / 64 / 7 + 1e-8)
    assert t.reshape(-1).tolist() == pytest.approx([3 / 8 / s, -5 / 8 / s, 3 / 8 / s, 3 / 8 / s])
    # no group baseline: the collapsed group 2 is compared with the batch, not zeroed
    assert (t[1] != 0).all()


def test_reinforce_pp_baseline_token_weighted_and_the_collapsed_group():
    # u = r − group mean = [0.5, −0.5, 0, 0]; token mean μ = (0.5 − 1.5)/8 = −1/8;
    # Σw(u − μ)² = 1·0.625² + 3·0.375² + 4·0.125² = 0.875; /7 = 0.125 -> s = sqrt(0.125 + 1e-8)
    kw = dict(lengths=L, weighting="token", eps_mode="var", eps=1e-8)
    s = math.sqrt(0.125 + 1e-8)
    verl = advantages.compute("reinforce_pp_baseline", R, zero_collapsed=False, **kw).values
    assert verl.reshape(-1).tolist() == pytest.approx(
        [0.625 / s, -0.375 / s, 0.125 / s] * 1 + [0.125 / s]
    )
    ours = advantages.compute("reinforce_pp_baseline", R, **kw).values
    assert ours[0].tolist() == pytest.approx([0.625 / s, -0.375 / s]) and (ours[1] == 0).all()
    # OpenRLHF's convention: population variance 0.875/8, s = sqrt(max(var, 1e-8))
    o = advantages.compute(
        "reinforce_pp_baseline",
        R,
        lengths=L,
        weighting="token",
        eps_mode="var_clamp",
        eps=1e-8,
        ddof=0,
        zero_collapsed=False,
    ).values
    so = math.sqrt(0.875 / 8)
    assert o[0, 0].item() == pytest.approx(0.625 / so)


def test_flash_reinforce():
    # batch mean 0.75, no whitening
    a = advantages.compute("flash_reinforce", R).values
    assert a.reshape(-1).tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25])


def test_grpo_passk():
    # [1, 0.5, 0.2, 0]: gap 1 − 0.5 = 0.5; mean 0.425, Σ(r − m)² = 0.5675, /3 -> σ = 0.434933
    r = torch.tensor([[1.0, 0.5, 0.2, 0.0]], dtype=D)
    a = advantages.compute("grpo_passk", r).values
    sigma = math.sqrt(0.5675 / 3)
    assert a[0].tolist() == pytest.approx([0.5 / (sigma + 1e-6), 0.0, 0.0, 0.0])
    raw = advantages.compute("grpo_passk", r, norm_by_std=False).values
    assert raw[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    # a tie at the top: nobody is the best, everyone gets 0; NaN is not a candidate
    assert (advantages.compute("grpo_passk", torch.tensor([[1.0, 1.0, 0.0]])).values == 0).all()
    r = torch.tensor([[math.nan, 0.3, 0.9]], dtype=D)
    assert advantages.compute("grpo_passk", r, norm_by_std=False).values[0].tolist() == (
        pytest.approx([0.0, 0.0, 0.6])
    )


def test_gpg_f_norm_std_and_fixed_alpha():
    # one live group [1, 0, 0, 0], nothing collapsed: the paper's α = B/(B − 0) = 1
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=D)
    assert advantages.compute("gpg", r).values[0].tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )
    # F_norm = std: GRPO's (r − 0.25)/(0.5 + 1e-6); a fixed α = 2 doubles it
    a = advantages.compute("gpg", r, f_norm="std", alpha=2.0).values
    assert a[0, 0].item() == pytest.approx(2 * 0.75 / 0.500001)


def test_opo_length_weighted_baseline():
    # b = (2·1)/(2 + 4 + 1 + 1) = 0.25 -> the plain mean here; with lengths 6, 1, 1, 0: b = 0.75
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=D)
    a = advantages.compute("opo", r, lengths=torch.tensor([[2, 4, 1, 1]])).values
    assert a[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    a = advantages.compute("opo", r, lengths=torch.tensor([[6, 1, 1, 0]])).values
    assert a[0].tolist() == pytest.approx([0.25, -0.75, -0.75, -0.75])


def test_remax():
    r = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, math.nan]], dtype=D)
    out = advantages.compute("remax", r, baseline=torch.tensor([0.5, math.nan], dtype=D))
    assert out.values[0].tolist() == pytest.approx([0.5, -0.5, 0.5])
    assert (out.values[1] == 0).all() and out.stats["remax/baseline_nan_frac"] == 0.5
    # G = 1 (ReMax's own setting): no group statistics needed
    one = advantages.compute(
        "remax", torch.tensor([[1.0], [0.0]]), baseline=torch.tensor([0.0, 1.0])
    )
    assert one.values.reshape(-1).tolist() == [1.0, -1.0]


def test_gdpo_keeps_what_grpo_on_the_sum_collapses():
    # GDPO paper Fig. 2: two binary rewards, two rollouts. Group 1: (1,0) vs (0,0), sums 1, 0;
    # group 2: (1,1) vs (0,0), sums 2, 0. GRPO on the sums gives both groups ±1/√2·√2/... the
    # same two values; GDPO adds one normalised term per varying reward: group 2 doubles.
    r3 = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]], dtype=D)
    grpo = advantages.compute("grpo", r3).values
    torch.testing.assert_close(grpo[0], grpo[1], atol=1e-5, rtol=0)  # equal up to eps
    comb = combine.normalize_then_sum(r3)  # a = 0.5/(√0.5 + 1e-4) per varying reward
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    same(comb, [[a, -a], [2 * a, -2 * a]])
    # then batch whitening: mean 0, Bessel σ over (a, −a, 2a, −2a) = a·sqrt(10/3), + 1e-4
    g = advantages.compute("gdpo", r3).values
    s = a * math.sqrt(10 / 3) + 1e-4
    same(g, [[a / s, -a / s], [2 * a / s, -2 * a / s]])


def test_reward_combinations_with_none_rewards():
    # f1 = [1, 0, None], f2 = [None, 1, 0]: each normalised over its two scored samples
    # (mean 0.5, Bessel σ = √0.5), a None adds 0; a sample every function skipped is NaN
    nan = math.nan
    r3 = torch.tensor([[[1.0, nan], [0.0, 1.0], [nan, 0.0], [nan, nan]]], dtype=D)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    got = combine.normalize_then_sum(r3)[0]
    assert got[:3].tolist() == pytest.approx([a, 0.0, -a]) and math.isnan(got[3])
    s = combine.weighted_sum(r3, [1.0, 2.0])[0]
    assert s[:3].tolist() == pytest.approx([1.0, 2.0, 0.0]) and math.isnan(s[3])


def test_combination_weights_are_read_in_the_rewards_dtype_and_device(under_wide_meta_defaults):
    # a weight of 0.1 beside float64 rewards is the float64 0.1 (not float32's 0.100000001);
    # under a default device of "meta" and dtype float64, float32 CPU rewards give float32 CPU
    r3 = torch.tensor([[[1.0, 3.0], [2.0, 0.0]]], dtype=D)
    assert combine.weighted_sum(r3, [0.1, 0.7])[0].tolist() == [1.0 * 0.1 + 3.0 * 0.7, 0.2]
    narrow = r3.float()
    for how in ("sum", "normalize_then_sum"):
        out = under_wide_meta_defaults(combine.combine, how, narrow, [0.1, 0.7])
        assert (out.device.type, out.dtype) == ("cpu", torch.float32)


def test_normalize_then_sum_of_one_function_with_its_weight_and_collapse_rule():
    # one function (K = 1), two groups: [1, 0] -> ±0.5/(√0.5 + 1e-4) = ±a, times the weight
    r = torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]], dtype=D)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    same(combine.normalize_then_sum(r), [[a, -a], [-a, a]])
    same(combine.normalize_then_sum(r, [2.0]), [[2 * a, -2 * a], [-2 * a, 2 * a]])
    same(combine.normalize_then_sum(r, [0.5]), [[a / 2, -a / 2], [-a / 2, a / 2]])
    # a group whose values differ by float noise (σ = 7e-10 < tau) adds exactly 0 by default;
    # without zero_collapsed it gives ±5e-10/(7e-10 + 1e-4) ≈ ±5e-6, as TRL does
    noisy = torch.tensor([[[0.5], [0.5 + 1e-9]]], dtype=D)
    assert combine.normalize_then_sum(noisy).tolist() == [[0.0, 0.0]]
    assert combine.normalize_then_sum(noisy, zero_collapsed=False).abs().min() > 1e-6
    # the collapse rule reads ddof and tau: [1, 0] has σ = 0.5 with ddof 0 (< 0.55: zero)
    half = r[:1]
    assert combine.normalize_then_sum(half, tau=0.55, ddof=0).tolist() == [[0.0, 0.0]]
    same(combine.normalize_then_sum(half, tau=0.55), [[a, -a]])


def test_combine_names_a_wrong_shape_or_eps():
    with pytest.raises(ValueError, match=r"must be a tensor \[P, G, K\], got \(2, 3\)"):
        combine.combine("sum", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"got <class 'list'>"):
        combine.combine("sum", [[1.0]])
    with pytest.raises(ValueError, match=r"^eps must be a finite number >= 0, got -1"):
        combine.normalize_then_sum(torch.zeros(1, 2, 1), eps=-1)


def test_reward_to_go_discount_skips_holes():
    # rewards −0.1 on each token, outcome 1 on the last: tokens [−0.1, −0.1, 0.9]; γ = 0.5:
    # G2 = 0.9, G1 = −0.1 + 0.45 = 0.35, G0 = −0.1 + 0.175 = 0.075. With a hole at t = 1
    # (mask 1, 0, 1) the hole is skipped: G0 = −0.1 + 0.5·0.9 = 0.35, G1 = 0.
    r = torch.tensor([[-0.1, -0.1, 0.9]], dtype=D)
    full = tokens.reward_to_go(r, torch.tensor([[True, True, True]]), 0.5)
    assert full[0].tolist() == pytest.approx([0.075, 0.35, 0.9])
    holed = tokens.reward_to_go(r, torch.tensor([[True, False, True]]), 0.5)
    assert holed[0].tolist() == pytest.approx([0.35, 0.0, 0.9])


def test_optimal_token_baseline_two_trajectories():
    # A: r = 1, 2 tokens, π = 0.5 and Σπ² = 0.5 at both -> w = 1 − 1 + 0.5 = 0.5, W = [0.5, 1];
    # B: r = 0, 1 token, π = 0.25, Σπ² = 0.25 -> w = 0.75, W = [0.75].
    # t = 0: B* = (1·0.5 + 0·0.75)/(1.25 + 1e-8) = 0.4 -> A: 0.6, B: −0.4.
    # t = 1: only A reaches it; A is strictly the longest, so its tail baseline is 0: A = 1.
    r = torch.tensor([[1.0, 0.0]], dtype=D)
    mask = torch.tensor([[[True, True], [True, False]]])
    old = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.5]]], dtype=D))
    spi = torch.tensor([[[0.5, 0.5], [0.25, 0.5]]], dtype=D)
    kw = dict(old_logp=old, sum_pi_squared=spi)
    out = advantages.compute_tokens("optimal_token_baseline", r, mask, **kw)
    b0 = 0.5 / (1.25 + 1e-8)
    same(out.token_values[0], [[1 - b0, 1.0], [-b0, 0.0]])
    # without the zero tail A's t = 1 baseline is its own return: 1 − 1/(1 + 1e-8) ≈ 0
    no_tail = advantages.compute_tokens(
        "optimal_token_baseline", r, mask, handle_zero_tail=False, **kw
    )
    assert no_tail.token_values[0, 0, 1].item() == pytest.approx(0.0, abs=1e-7)


def test_kl_reward_and_adaptive_controller():
    # k1 = logp − ref = [0.5, −0.5]; coef 0.1 -> dense rewards [−0.05, 0.05]; mean KL 0
    dense, kl = advantages.kl_reward(
        torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]]), torch.ones(1, 2), 0.1
    )
    assert dense[0].tolist() == pytest.approx([-0.05, 0.05]) and kl == pytest.approx(0.0)
    # β 0.1, target 0.1, horizon 100: KL 0.2 -> error clip(1, ±0.2) = 0.2 -> β·(1 + 0.2·10/100)
    c = AdaptiveKLController(coef=0.1, target=0.1, horizon=100)
    assert c.update(0.2, 10) == pytest.approx(0.102)
    assert c.update(0.05, 10) == pytest.approx(0.102 * 0.98)  # error −0.5 clipped to −0.2
    d = make_kl_controller("adaptive", coef=0.1)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value


def test_token_path_of_a_sequence_estimator_two_readings():
    # grpo on [1, 0] (σ = √0.5): ±0.5/(√0.5 + 1e-6); dense reward −0.1 on every one of 2 tokens.
    r = torch.tensor([[1.0, 0.0]], dtype=D)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    dense = torch.full((1, 2, 2), -0.1, dtype=D)
    # "score": the score shifts both samples by −0.2: grpo is shift-invariant -> unchanged
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    s = advantages.compute_tokens("grpo", r, mask, token_rewards=dense)
    same(s.token_values[0], [[a, a], [-a, -a]])
    # "return": the dense reward-to-go is added per token: −0.2 at t = 0, −0.1 at t = 1
    t = advantages.compute_tokens("grpo", r, mask, token_rewards=dense, token_rewards_as="return")
    same(t.token_values[0], [[a - 0.2, a - 0.1], [-a - 0.2, -a - 0.1]])


def test_compute_tokens_reads_combine_params_and_remaxs_baseline_on_the_score_path():
    # the combination's eps reaches it through compute_tokens as through compute: with eps 1
    # a group [1, 0] normalises to ±0.5/(√0.5 + 1) before GRPO (whose values do not change
    # with that scale, so compare the KL-free dr_grpo: its values are the centred rewards)
    r3 = torch.tensor([[[1.0], [0.0]]], dtype=D)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    kw = {"combine": "normalize_then_sum", "combine_params": {"eps": 1.0}}
    tok = advantages.compute_tokens("dr_grpo", r3, mask, **kw)
    b = 0.5 / (math.sqrt(0.5) + 1.0)
    same(tok.values, [[b, -b]])
    # remax with dense rewards read as a score: (r + Σ dense) − the greedy baseline
    r = torch.tensor([[1.0, 0.0]], dtype=D)
    dense = torch.full((1, 2, 2), 0.25, dtype=D)
    out = advantages.compute_tokens(
        "remax", r, mask, token_rewards=dense, token_rewards_as="score",
        baseline=torch.tensor([0.5], dtype=D),
    )  # fmt: skip
    same(out.values, [[1.0, 0.0]])  # 1.5 − 0.5, 0.5 − 0.5


def test_compute_tokens_reports_the_nan_fraction():
    # a token estimator does not report nan_frac itself: compute_tokens adds it (1 of 4)
    r = torch.tensor([[1.0, math.nan], [0.0, 1.0]], dtype=D)
    out = advantages.compute_tokens("reinforce_pp_global", r, torch.ones(2, 2, 2, dtype=torch.bool))
    assert out.stats["nan_frac"] == 0.25


def test_a_list_of_rewards_for_a_combination_is_refused_with_a_value_error():
    with pytest.raises(ValueError, match="per-function rewards must be a tensor"):
        advantages.compute("gdpo", [[1.0, 0.0]])


def test_the_focal_weight_clips_a_success_rate_above_the_range():
    # mean reward 1.5 on [0, 1]: μ̂ = clip(1.5, 0, 1) = 1, so (1 − 1)^0.5 = 0 (never NaN)
    r = torch.tensor([[1.5, 1.5], [0.0, 1.0]], dtype=D)
    w = advantages.transforms.focal_weight(r, None, 0.5)
    assert w.tolist() == pytest.approx([0.0, math.sqrt(0.5)], abs=1e-15)


def test_a_token_estimator_reads_the_combinations_params():
    # a policy certain of its tokens (log π = 0, Σπ² = 1) makes the optimal token baseline 0,
    # so each token's advantage is its return: the combined reward ±0.5/(√0.5 + eps), eps = 1
    r3 = torch.tensor([[[1.0], [0.0]]], dtype=D)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    zeros = torch.zeros(1, 2, 2, dtype=D)
    out = advantages.compute_tokens(
        "optimal_token_baseline", r3, mask, old_logp=zeros, sum_pi_squared=zeros + 1.0,
        combine="normalize_then_sum", combine_params={"eps": 1.0},
    )  # fmt: skip
    b = 0.5 / (math.sqrt(0.5) + 1.0)
    same(out.token_values[0], [[b, b], [-b, -b]])
