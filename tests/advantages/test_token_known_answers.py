"""REINFORCE++ and REINFORCE++-baseline on tokens, by hand in plain Python: the defaults
(γ = 1, verl's ``masked_whiten`` with eps_mode "var", eps 1e-8, ddof 1, collapsed groups
zeroed), the batch statistics and the result's fields. Written against the survivors of the
mutation run (docs/mutation.md)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages

# 2 prompts × 3 samples × up to 3 tokens; group 1 is collapsed (all rewards 1), sample
# (0, 2) has a NaN reward (left out)
R = torch.tensor([[1.0, 0.0, math.nan], [1.0, 1.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor(
    [[[1, 1, 0], [1, 1, 1], [1, 0, 0]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool
)
LENGTHS = [[2, 3, 1], [1, 2, 3]]


def _whiten(values: dict) -> tuple[dict, float, float]:
    """verl masked_whiten over the valid tokens: (x − μ)/√(σ² + 1e-8), σ² with ddof 1."""
    xs = list(values.values())
    mu = sum(xs) / len(xs)
    var = sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)
    s = math.sqrt(var + 1e-8)
    return {k: (x - mu) / s for k, x in values.items()}, mu, s


def _tokens_of(values: dict) -> torch.Tensor:
    out = torch.zeros(2, 3, 3, dtype=torch.float64)
    for (p, g, t), v in values.items():
        out[p, g, t] = v
    return out


def _valid_tokens():
    return [
        (p, g, t)
        for p in range(2)
        for g in range(3)
        for t in range(LENGTHS[p][g])
        if not math.isnan(R[p, g])
    ]


def test_reinforce_pp_baseline_on_tokens_by_hand():
    # u = r − group mean of the valid rewards on every token of the sample: group 0 has
    # mean 0.5 (u = ±0.5), group 1 mean 1 (u = 0); whitened over the 8 valid tokens; the
    # collapsed group 1 is then set to 0
    u = {(p, g, t): float(R[p, g]) - (0.5 if p == 0 else 1.0) for p, g, t in _valid_tokens()}
    white, mu, s = _whiten(u)
    want = {k: (0.0 if k[0] == 1 else v) for k, v in white.items()}
    out = advantages.compute_tokens("reinforce_pp_baseline", R, MASK)
    torch.testing.assert_close(out.token_values, _tokens_of(want), rtol=0, atol=1e-12)
    seq = [
        [sum(want.get((p, g, t), 0.0) for t in range(3)) / LENGTHS[p][g] for g in range(3)]
        for p in range(2)
    ]
    seq[0][2] = 0.0  # the NaN sample
    torch.testing.assert_close(
        out.values, torch.tensor(seq, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert out.stats["batch_mean"] == pytest.approx(mu, abs=1e-12)
    assert out.stats["collapsed_frac"] == 0.5
    assert out.scale.tolist() == pytest.approx([s, s])
    assert out.keep.tolist() == [True, True] and out.kl_weight.tolist() == [1.0, 1.0]
    assert out.updated.tolist() == [True, False]
    # without the zeroing, the collapsed group keeps the whitening shift (the peers' way)
    kept = advantages.compute_tokens("reinforce_pp_baseline", R, MASK, zero_collapsed=False)
    torch.testing.assert_close(kept.token_values, _tokens_of(white), rtol=0, atol=1e-12)
    assert kept.updated.tolist() == [True, True]
    assert kept.stats["collapsed_frac"] == 0.5  # still counted, though not zeroed


def test_reinforce_pp_global_on_tokens_by_hand():
    # the outcome sits on each sample's last token; γ = 1 returns carry it to every earlier
    # token; whitened over the valid tokens; no group baseline, nothing zeroed
    ret = {(p, g, t): float(R[p, g]) for p, g, t in _valid_tokens()}
    white, mu, s = _whiten(ret)
    out = advantages.compute_tokens("reinforce_pp_global", R, MASK)
    torch.testing.assert_close(out.token_values, _tokens_of(white), rtol=0, atol=1e-12)
    assert out.stats["batch_mean"] == pytest.approx(mu, abs=1e-12)
    assert out.stats["collapsed_frac"] == 0.5  # reported, not acted on
    assert out.scale.tolist() == pytest.approx([s, s])
    assert out.updated.tolist() == [True, True]
    # γ < 1 discounts by the valid tokens between: a return γ^(distance to the last token)
    half = advantages.compute_tokens("reinforce_pp_global", R, MASK, gamma=0.5)
    disc = {
        (p, g, t): float(R[p, g]) * 0.5 ** (LENGTHS[p][g] - 1 - t) for p, g, t in _valid_tokens()
    }
    torch.testing.assert_close(half.token_values, _tokens_of(_whiten(disc)[0]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baseline_zeroes_a_collapsed_group_by_default(name):
    # one all-correct group r = [1, 1, 1], lengths 4, 2, 2 (a unique longest): every return is
    # 1; verl's zero tail sets the baseline of the longest beyond the second-longest length
    # (positions 2, 3) to 0, so the peers give those tokens A = 1 - 0 = 1. zero_collapsed
    # (the default, [OURS]) zeroes the whole group (σ of its scores is 0 < tau); scale is 1.
    r = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]], dtype=torch.bool)
    old_logp = torch.full(mask.shape, math.log(0.5), dtype=torch.float64)
    kw = dict(old_logp=old_logp, sum_pi_squared=torch.full(mask.shape, 0.5, dtype=torch.float64))
    out = advantages.compute_tokens(name, r, mask, **kw)
    assert out.token_values.abs().sum().item() == 0.0
    assert out.scale.tolist() == [1.0]
    assert out.stats["collapsed_frac"] == 1.0  # the one group
    peer = advantages.compute_tokens(name, r, mask, zero_collapsed=False, **kw)
    assert peer.token_values[0, 0, 2:].tolist() == [1.0, 1.0]
    assert peer.stats["collapsed_frac"] == 1.0  # still counted, though not zeroed


@pytest.mark.parametrize("reading", ["score", "return"])
def test_reinforce_pp_baselines_collapse_rule_reads_ddof_and_tau(reading):
    # group 0's valid rewards 1, 0: σ = 0.707 (ddof 1) or 0.5 (ddof 0); group 1 is collapsed
    # (σ = 0). With tau = 0.6 group 0 stays (ddof 1) or collapses too (ddof 0). Without dense
    # rewards both readings centre r on the group mean: the same values as the hand test's
    kw = {"token_rewards_as": reading}
    base = advantages.compute_tokens("reinforce_pp_baseline", R, MASK)
    same = advantages.compute_tokens("reinforce_pp_baseline", R, MASK, **kw)
    torch.testing.assert_close(same.token_values, base.token_values, rtol=0, atol=1e-12)
    one = advantages.compute_tokens("reinforce_pp_baseline", R, MASK, tau=0.6, **kw)
    assert one.stats["collapsed_frac"] == 0.5 and one.token_values[0].abs().sum() > 0
    zero = advantages.compute_tokens("reinforce_pp_baseline", R, MASK, tau=0.6, ddof=0, **kw)
    assert zero.stats["collapsed_frac"] == 1.0 and zero.token_values.abs().sum() == 0


def test_the_optimal_token_baseline_names_a_missing_or_misshapen_input():
    # through compute_tokens and through the registry's function itself (TOKEN_ESTIMATORS:
    # ``fn(rewards, valid, mask, token_rewards, **params)``), which checks its own inputs
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    good = torch.full(mask.shape, -0.5, dtype=torch.float64)
    direct = advantages.TOKEN_ESTIMATORS["optimal_token_baseline"]
    calls = (
        lambda **kw: advantages.compute_tokens("optimal_token_baseline", r, mask, **kw),
        lambda **kw: direct(r, None, mask, torch.zeros_like(good), **kw),
    )
    for call in calls:
        for missing in ("old_logp", "sum_pi_squared"):
            kw = {"old_logp": good, "sum_pi_squared": good}
            del kw[missing]
            with pytest.raises(ValueError, match=r"needs old_logp .* and sum_pi_squared"):
                call(**kw)
        for name in ("old_logp", "sum_pi_squared", "is_weights"):
            kw = {"old_logp": good, "sum_pi_squared": good, name: good[..., :2]}
            with pytest.raises(ValueError, match=rf"^{name} must have the mask's shape"):
                call(**kw)


def test_the_optimal_token_baseline_computes_in_the_rewards_dtype():
    # float32 behaviour log-probs, Σπ² and IS weights beside float64 rewards: cast to float64
    # before exp / square, so the result equals that of the same values given as float64
    g = torch.Generator().manual_seed(0)
    r = torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[[1, 1, 1], [1, 1, 0], [1, 0, 0]]], dtype=torch.bool)
    narrow = {
        "old_logp": -torch.rand(mask.shape, generator=g) * 3,
        "sum_pi_squared": torch.rand(mask.shape, generator=g),
        "is_weights": 1 + torch.rand(mask.shape, generator=g) * 3,
    }
    wide = {k: v.double() for k, v in narrow.items()}
    dense = torch.zeros(mask.shape, dtype=torch.float64)
    direct = advantages.TOKEN_ESTIMATORS["optimal_token_baseline"]  # no cast before it
    b = advantages.compute_tokens("optimal_token_baseline", r, mask, **wide)
    for a in (
        advantages.compute_tokens("optimal_token_baseline", r, mask, **narrow),
        direct(r, None, mask, dense, **narrow),
    ):
        assert a.token_values.dtype == torch.float64
        torch.testing.assert_close(a.token_values, b.token_values, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baseline_of_a_group_of_one_is_zero(name):
    # one sample per group: no other sample to form a baseline, so 0 (ALGORITHMS.md §0); scale 1
    r = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    mask = torch.ones(2, 1, 2, dtype=torch.bool)
    g = torch.full(mask.shape, -0.5, dtype=torch.float64)
    out = advantages.compute_tokens(name, r, mask, old_logp=g, sum_pi_squared=g)
    assert out.token_values.abs().sum().item() == 0.0 and out.scale.tolist() == [1.0, 1.0]


def test_updated_marks_only_the_groups_with_a_valid_sample():
    # group 0 has no valid reward, group 1 has two: only group 1 is updated (the batch's
    # other group being valid must not mark it). REINFORCE++ zeroes no group, so updated is
    # exactly "has a valid sample"; every token of group 0 is 0.
    r = torch.tensor([[math.nan, math.nan], [1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    out = advantages.compute_tokens("reinforce_pp_global", r, mask)
    assert out.updated.tolist() == [False, True]
    assert out.token_values[0].abs().sum().item() == 0.0


def test_reinforce_pp_globals_collapsed_frac_reads_the_valid_mask_ddof_and_tau():
    # collapsed_frac is reported, not acted on. [1, 1, NaN]: σ of the valid [1, 1] is 0, so
    # the group is collapsed (its NaN must not make σ NaN); [1, 0, 1] is not: 1/2.
    r = torch.tensor([[1.0, 1.0, math.nan], [1.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    assert advantages.compute_tokens("reinforce_pp_global", r, mask).stats["collapsed_frac"] == 0.5
    # [1, 0]: σ = 0.5 with ddof 0 (< tau = 0.55: collapsed), 0.707 with ddof 1; [1, 1]: 0
    r2 = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    mask2 = torch.ones(2, 2, 2, dtype=torch.bool)
    kw = {"tau": 0.55}
    one = advantages.compute_tokens("reinforce_pp_global", r2, mask2, **kw)
    zero = advantages.compute_tokens("reinforce_pp_global", r2, mask2, ddof=0, **kw)
    assert (one.stats["collapsed_frac"], zero.stats["collapsed_frac"]) == (0.5, 1.0)


def _certain(mask):
    # a policy that is certain of every sampled token: π = 1 (log π = 0) and Σ_v π² = 1, so
    # w = 1 − 2π + Σπ² = 0, W_t = 0 and B_t = 0/(0 + eps) = 0: each advantage is its return
    zeros = torch.zeros(mask.shape, dtype=torch.float64)
    return {"old_logp": zeros, "sum_pi_squared": zeros + 1.0}


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baselines_groups_count_only_their_valid_samples(name):
    # B_t = 0 (``_certain``), so a live group's advantages are the returns: 1 on both tokens
    # of a reward-1 sample, 0 for a reward 0. Group 0 [1, 1, NaN]: its valid scores [1, 1]
    # have σ = 0: collapsed (by default zeroed). Group 1 [1, NaN, NaN]: one valid sample, no
    # baseline: 0 either way (§0). Group 2 [1, 0, 1]: σ = 0.577, live.
    r = torch.tensor(
        [[1.0, 1.0, math.nan], [1.0, math.nan, math.nan], [1.0, 0.0, 1.0]], dtype=torch.float64
    )
    mask = torch.ones(3, 3, 2, dtype=torch.bool)
    live = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    out = advantages.compute_tokens(name, r, mask, **_certain(mask))
    assert out.token_values[:2].abs().sum().item() == 0.0
    assert torch.equal(out.token_values[2], live)
    assert out.stats["collapsed_frac"] == pytest.approx(2 / 3)
    assert out.updated.tolist() == [False, False, True]
    peer = advantages.compute_tokens(name, r, mask, zero_collapsed=False, **_certain(mask))
    first = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(peer.token_values[0], first)  # the NaN sample stays 0
    assert peer.token_values[1].abs().sum().item() == 0.0  # one valid sample: still 0
    assert torch.equal(peer.token_values[2], live)
    assert peer.stats["collapsed_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baselines_collapse_rule_reads_ddof_and_tau(name):
    # scores [1, 0]: σ = 0.5 with ddof 0 (< tau = 0.55: collapsed, zeroed), 0.707 with the
    # default ddof 1 (live: the returns, B_t = 0 by ``_certain``)
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    one = advantages.compute_tokens(name, r, mask, tau=0.55, **_certain(mask))
    zero = advantages.compute_tokens(name, r, mask, tau=0.55, ddof=0, **_certain(mask))
    assert one.token_values[0].tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert one.stats["collapsed_frac"] == 0.0
    assert zero.token_values.abs().sum().item() == 0.0 and zero.stats["collapsed_frac"] == 1.0
