"""step_metrics: hand-derived values on a small batch, key set, NaN-free output."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import advantages
from grouprl.diagnostics import STEP_METRIC_KEYS, inverse_scale_tail, step_metrics
from grouprl.types import Advantages

NAN = float("nan")


def _adv(values, scale, keep=None, kl_weight=None):
    values = torch.as_tensor(values, dtype=torch.float32)
    p = values.shape[0]
    return Advantages(
        values=values,
        keep=torch.ones(p, dtype=torch.bool) if keep is None else torch.as_tensor(keep),
        kl_weight=torch.ones(p) if kl_weight is None else torch.as_tensor(kl_weight),
        scale=scale
        if isinstance(scale, torch.Tensor)
        else torch.tensor(scale, dtype=torch.float32),
    )


def test_step_metrics_hand_derived():
    r = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, NAN, 0.0]]
    )
    # Group 2: mean 0.5, σ(ddof1) = sqrt(1/3) = 0.57735; group 3: valid [1,0,0] mean 1/3,
    # σ = sqrt(((2/3)^2 + 2(1/3)^2)/2) = sqrt(1/3) as well.
    s = 3**-0.5
    values = [
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s],
        [2 / 3 / s, -1 / 3 / s, 0, -1 / 3 / s],
    ]
    adv = _adv(values, scale=[1e-6, 1e-6, s, s], kl_weight=[1.0, 1.0, 2.0, 4.0])
    expected = {
        # groups 0 (all 1) and 1 (all 0) collapsed; groups 2, 3 mixed; every group has >= 3
        # valid rewards, so none is insufficient
        "acr/rate": 0.5,
        "acr/all_correct": 0.25,
        "acr/all_wrong": 0.25,
        "acr/other": 0.0,
        "acr/insufficient": 0.0,
        "acr/groups": 4.0,
        # 15 valid rewards, 4 + 0 + 2 + 1 = 7 ones: mean 7/15, population std sqrt(p(1-p))
        "reward/mean": 7 / 15,
        "reward/std": math.sqrt(7 / 15 * 8 / 15),
        "reward/nan_count": 1.0,
        "reward/nan_frac": 1 / 16,
        # |A| over the 15 valid samples of kept groups: group 2 sums 4·0.5/s, group 3 (4/3)/s
        "adv/abs_mean": (2 / s + 4 / 3 / s) / 15,
        "adv/abs_max": 2 / 3 / s,
        "adv/keep_frac": 1.0,
        "adv/updated_frac": 0.5,
        "adv/kl_weight_mean": (1 + 1 + 2 + 4) / 4,
        "adv/kl_weight_max": 4.0,
        # collapsed groups (scale 1e-6) are not updated, so they stay out of the tail: the two
        # updated groups both have 1/scale = 1/s, so every quantile is 1/s = sqrt(3)
        "scale/inv_p50": 1 / s,
        "scale/inv_p95": 1 / s,
        "scale/inv_p99": 1 / s,
        "scale/inv_max": 1 / s,
        # σ of the two live groups is s for both: mean s, coefficient of variation 0
        "regime/sigma_mean": s,
        "regime/sigma_cv": 0.0,
        # mixed groups 2 ([1, 0, 1, 0]: μ̂ 0.5, counts) and 3 (one 1 of 3 valid: μ̂ 1/3)
        "regime/mixed_hi_frac": 0.5,
    }
    m = step_metrics(r, adv)
    assert list(m) == list(STEP_METRIC_KEYS) == list(expected)
    for key, want in expected.items():
        assert m[key] == pytest.approx(want, rel=1e-6, abs=1e-7), key


def test_step_metrics_second_hand_built_batch():
    # A second batch where values the first one shares come apart (unequal scales, so the
    # four tail quantiles differ; unequal kl weights, so mean != max; a NaN inside a collapsed
    # group; partial credit). Group 0: [1, 0, 0, 0]; group 1: [1, 1, 1, NaN]; group 2:
    # [0.5, 1, 0, 0].
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, NAN], [0.5, 1.0, 0.0, 0.0]])
    # Hand-built advantages, scales 0.5 and 0.25 for the two live groups.
    values = [[0.9, -0.3, -0.3, -0.3], [0.0, 0.0, 0.0, 0.0], [0.2, 1.8, -1.0, -1.0]]
    adv = _adv(values, scale=[0.5, 1e-6, 0.25], kl_weight=[1.0, 1.0, 7.0])
    m = step_metrics(r, adv)
    s0 = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # σ (ddof 1) of [1, 0, 0, 0] = 0.5
    s2 = math.sqrt((0.125**2 + 0.625**2 + 2 * 0.375**2) / 3)  # of [0.5, 1, 0, 0] = 0.4787
    valid = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0]  # the 11 valid rewards
    mu = sum(valid) / 11
    sigma_mean = (s0 + s2) / 2
    expected = {
        "acr/rate": 1 / 3,  # group 1 (all correct among its valid rewards)
        "acr/all_correct": 1 / 3,
        "acr/all_wrong": 0.0,
        "acr/other": 0.0,
        "acr/insufficient": 0.0,
        "acr/groups": 3.0,
        "reward/mean": mu,  # 5.5 / 11 = 0.5
        "reward/std": math.sqrt(sum((x - mu) ** 2 for x in valid) / 11),
        "reward/nan_count": 1.0,
        "reward/nan_frac": 1 / 12,
        "adv/abs_mean": (1.8 + 0 + 4.0) / 11,  # |A| summed over the 11 valid samples
        "adv/abs_max": 1.8,
        "adv/keep_frac": 1.0,
        "adv/updated_frac": 2 / 3,
        "adv/kl_weight_mean": 3.0,
        "adv/kl_weight_max": 7.0,
        # 1/scale over the updated groups: {2, 4}; linear quantiles 2 + q·(4 − 2)
        "scale/inv_p50": 3.0,
        "scale/inv_p95": 3.9,
        "scale/inv_p99": 3.98,
        "scale/inv_max": 4.0,
        "regime/sigma_mean": sigma_mean,
        "regime/sigma_cv": abs(s0 - s2) / 2 / sigma_mean,  # population std of two values
        "regime/mixed_hi_frac": 0.0,  # mixed groups 0 and 2 have μ̂ 0.25 and 0.375
    }
    assert list(m) == list(expected)
    for key, want in expected.items():
        assert m[key] == pytest.approx(want, rel=1e-6, abs=1e-9), key


def test_step_metrics_nothing_updated_is_nan_free():
    r = torch.zeros(3, 4)
    m = step_metrics(r, _adv(torch.zeros(3, 4), scale=[1e-6] * 3))
    assert all(math.isfinite(v) for v in m.values())
    assert m["acr/rate"] == 1.0 and m["scale/inv_p95"] == 0.0 and m["adv/updated_frac"] == 0.0


def test_inverse_scale_quantiles_match_numpy_rule():
    # 100 updated groups with scale 1/k, k = 1..100: torch (linear) quantile of 1..100 at 0.95
    # is 1 + 0.95·99 = 95.05.
    p = 100
    scale = 1.0 / torch.arange(1, p + 1, dtype=torch.float64)
    adv = _adv(torch.ones(p, 2), scale=scale)
    q = inverse_scale_tail(adv, (0.95, 0.99))
    assert q.tolist() == pytest.approx([95.05, 99.01], abs=1e-9)
    # Masking to the first 10 groups: quantile of 1..10 at 0.95 = 1 + 0.95·9 = 9.55.
    mask = torch.arange(p) < 10
    assert inverse_scale_tail(adv, (0.95,), mask=mask).item() == pytest.approx(9.55, abs=1e-9)
    # A dropped group (keep False) is not updated.
    adv2 = _adv(torch.ones(2, 2), scale=[1e-3, 1.0], keep=[False, True])
    assert inverse_scale_tail(adv2, (1.0,)).item() == pytest.approx(1.0)


def test_step_metrics_with_real_estimators():
    # Group 0: σ = 1e-4 jitter (updated by GRPO with 1/scale ≈ 1e4); group 1 collapsed.
    r = torch.tensor([[0.5, 0.5001, 0.5, 0.5001], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    sigma0 = torch.tensor([0.5, 0.5001, 0.5, 0.5001]).std().item()
    g = step_metrics(r, advantages.compute("grpo", r))
    assert g["acr/rate"] == pytest.approx(1 / 3) and g["adv/updated_frac"] == pytest.approx(2 / 3)
    assert g["scale/inv_max"] == pytest.approx(1 / (sigma0 + 1e-6), rel=1e-3)
    m = step_metrics(r, advantages.compute("maxnorm_rloo", r, delta_res=1e-2))
    # The jitter group and the constant group are one bin each -> both skipped (keep False);
    # the mixed group is bounded by 1/tau_res = 100.
    assert m["adv/keep_frac"] == pytest.approx(1 / 3) and m["scale/inv_max"] <= 100.0
    assert m["adv/abs_max"] <= 1.0 + 1e-6


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda g: st.lists(
            st.lists(st.sampled_from([0.0, 1.0, 0.25, NAN]), min_size=g, max_size=g),
            min_size=1,
            max_size=10,
        )
    ),
    st.randoms(use_true_random=False),
)
def test_step_metrics_properties(rows, rnd):
    r = torch.tensor(rows, dtype=torch.float32)
    m = step_metrics(r, advantages.compute("grpo", r))
    assert all(math.isfinite(v) for v in m.values())
    # The split partitions the collapsed groups; fractions in [0, 1].
    parts = m["acr/all_correct"] + m["acr/all_wrong"] + m["acr/other"]
    assert parts == pytest.approx(m["acr/rate"], abs=1e-12)
    assert m["reward/nan_count"] == float(torch.isnan(r).sum())
    # grpo updates exactly the non-collapsed groups.
    assert m["adv/updated_frac"] == pytest.approx(1.0 - m["acr/rate"], abs=1e-12)
    # Permuting the groups changes nothing.
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    rp = r[perm]
    mp = step_metrics(rp, advantages.compute("grpo", rp))
    for k in m:
        assert mp[k] == pytest.approx(m[k], rel=1e-6, abs=1e-9), k


def test_mixed_hi_frac_rescales_by_the_reward_range_and_ignores_collapsed_groups():
    # rewards in [-1, 1]: group means 0.5 -> μ̂ 0.75 (counts), -0.5 -> 0.25, 0.0 -> 0.5
    # (counts: the boundary is inclusive); the all-correct group is collapsed and left out
    r = torch.tensor(
        [[1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, -1.0, 1.0], [1.0, -1.0, 1.0, -1.0], [1.0] * 4]
    )
    adv = _adv([[0.0] * 4] * 4, scale=[1.0] * 4, kl_weight=[1.0] * 4)
    m = step_metrics(r, adv, reward_range=(-1.0, 1.0))
    assert m["regime/mixed_hi_frac"] == pytest.approx(2 / 3)
    # every group collapsed: no mixed group, 0.0 (never NaN in metrics.jsonl)
    assert (
        step_metrics(torch.ones(2, 4), _adv([[0.0] * 4] * 2, scale=[1.0] * 2, kl_weight=[1.0] * 2))[
            "regime/mixed_hi_frac"
        ]
        == 0.0
    )
