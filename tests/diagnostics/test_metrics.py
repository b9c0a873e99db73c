"""step_metrics: hand-derived values on a small batch, key set, NaN-free output."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    m = step_metrics(r, adv)
    assert list(m) == list(STEP_METRIC_KEYS)
    assert m["acr/rate"] == pytest.approx(0.5)
    assert m["acr/all_correct"] == pytest.approx(0.25)
    assert m["acr/all_wrong"] == pytest.approx(0.25)
    assert m["acr/other"] == 0.0
    assert m["acr/groups"] == 4.0
    # 15 valid rewards, 4 + 0 + 2 + 1 = 7 ones -> mean 7/15.
    assert m["reward/mean"] == pytest.approx(7 / 15, abs=1e-12)
    assert m["reward/std"] == pytest.approx(math.sqrt(7 / 15 * 8 / 15), abs=1e-7)
    assert m["reward/nan_count"] == 1.0
    assert m["reward/nan_frac"] == pytest.approx(1 / 16)
    # |A| over 15 valid kept samples: group 2 sum 4·0.5/s, group 3 sum (4/3)/s.
    assert m["adv/abs_mean"] == pytest.approx((2 / s + 4 / 3 / s) / 15, abs=1e-6)
    assert m["adv/abs_max"] == pytest.approx(2 / 3 / s, abs=1e-6)
    assert m["adv/updated_frac"] == 0.5 and m["adv/keep_frac"] == 1.0
    assert m["adv/kl_weight_mean"] == pytest.approx(2.0) and m["adv/kl_weight_max"] == 4.0
    # Collapsed groups (scale 1e-6) are not updated, so they do not enter the tail.
    assert m["scale/inv_p99"] == pytest.approx(1 / s, rel=1e-6)
    assert m["scale/inv_max"] == pytest.approx(1 / s, rel=1e-6)
    assert m["regime/sigma_mean"] == pytest.approx(s, abs=1e-7)
    assert m["regime/sigma_cv"] == pytest.approx(0.0, abs=1e-6)


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
    advantages = pytest.importorskip("grouprl.advantages")
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
    advantages = pytest.importorskip("grouprl.advantages")
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
