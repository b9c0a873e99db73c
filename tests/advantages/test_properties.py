"""Hypothesis properties of the advantage layer (docs/design.md's list)."""

import math

import inputs
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from grouprl import advantages

ALL = advantages.names()
GROUP_LOCAL = [
    "grpo",
    "dr_grpo",
    "rloo",
    "gopo",
    "p90",
    "maxnorm_rloo",
    "maxnorm_dr_grpo",
    "grpo_beta_comp",
]
MEAN_CENTRED = [
    "grpo",
    "dr_grpo",
    "rloo",
    "batch_std",
    "reinforce_pp",
    "gopo",
    "p90",
    "maxnorm_rloo",
    "maxnorm_dr_grpo",
    "grpo_beta_comp",
    "sigma_weighted_grpo",
    "reinforce_pp_baseline",
    "gdpo",
    "gpg",
]
# no group baseline: a group whose rewards are all equal is compared with the batch
NO_GROUP_RULE = ["reinforce_pp_global", "flash_reinforce"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# rewards on a grid (binary, partial credit) or continuous, NaN allowed
levels = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, math.nan])


@st.composite
def batches(draw, min_p=1, max_p=6, min_g=2, max_g=8, nan=True):
    p = draw(st.integers(min_p, max_p))
    g = draw(st.integers(min_g, max_g))
    elem = levels if nan else st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
    if draw(st.booleans()):
        # continuous rewards, on a 1e-6 grid so that shifting by a constant cannot merge two
        # distinct rewards by rounding (e.g. 1e-308 + 3 == 0 + 3)
        cont = st.floats(0, 1, allow_nan=False).map(lambda x: round(x, 6))
        elem = cont if not nan else st.one_of(cont, st.just(math.nan))
    arr = draw(arrays(np.float64, (p, g), elements=elem))
    return torch.tensor(arr)


@SETTINGS
@given(batches(), st.sampled_from(MEAN_CENTRED))
def test_zero_mean_per_group(rewards, name):
    out = inputs.compute(name, rewards)
    valid = ~torch.isnan(rewards)
    sums = torch.where(valid, out.values, torch.zeros_like(out.values)).sum(1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-9)


@SETTINGS
@given(
    batches(),
    st.sampled_from([n for n in ALL if n not in NO_GROUP_RULE]),
    st.integers(0, 5),
    st.sampled_from([0.0, 0.25, 1.0]),
)
def test_collapsed_group_is_exactly_zero(rewards, name, row, value):
    row = row % rewards.shape[0]
    rewards[row] = torch.where(
        torch.isnan(rewards[row]), rewards[row], torch.full_like(rewards[row], value)
    )
    out = inputs.compute(name, rewards)
    assert (out.values[row] == 0).all()


@SETTINGS
@given(batches(), st.sampled_from(ALL), st.sampled_from([-3.0, -0.5, 0.5, 7.0]))
def test_shift_invariance(rewards, name, c):
    a = inputs.compute(name, rewards).values
    b = inputs.compute(name, rewards + c).values
    assert torch.allclose(a, b, atol=1e-9)


@SETTINGS
@given(
    batches(),
    st.sampled_from(
        [
            "grpo",
            "batch_std",
            "reinforce_pp",
            "gopo",
            "sigma_weighted_grpo",
            "grpo_beta_comp",
            "reinforce_pp_global",
            "gdpo",
            "grpo_passk",
        ]
    ),
    st.sampled_from([0.5, 2.0, 10.0]),
)
def test_scale_invariance_where_std_normalised(rewards, name, c):
    kw = {} if name == "gopo" else {"eps": 0.0}
    if name == "gdpo":
        kw["combine_params"] = {"eps": 0.0}
    a = inputs.compute(name, rewards, **kw).values
    b = inputs.compute(name, rewards * c, **kw).values
    assert torch.allclose(a, b, atol=1e-9)


@SETTINGS
@given(batches(), st.sampled_from(ALL), st.randoms(use_true_random=False))
def test_permutation_equivariance(rewards, name, rnd):
    p, g = rewards.shape
    rows = list(range(p))
    cols = list(range(g))
    rnd.shuffle(rows)
    rnd.shuffle(cols)
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    a = inputs.compute(name, rewards).values
    b = inputs.compute(name, rewards[rows_t][:, cols_t]).values
    assert torch.allclose(a[rows_t][:, cols_t], b, atol=1e-9)


@SETTINGS
@given(
    batches(), st.sampled_from(["maxnorm_rloo", "maxnorm_dr_grpo"]), st.sampled_from([None, 1e-2])
)
def test_maxnorm_bounded_sign_order_ratio(rewards, name, delta):
    out = inputs.compute(name, rewards, delta_res=delta)
    a = out.values
    assert (a.abs() <= 1 + 1e-12).all()
    assert (1.0 / out.scale <= 1 / 1e-2 + 1e-6).all()  # inverse scale bounded by 1/tau_res
    if delta is None:
        base = advantages.compute("rloo" if name == "maxnorm_rloo" else "dr_grpo", rewards).values
        # same signs, same order, same ratios as the raw numerator: a = base / s_q
        assert torch.equal(torch.sign(a), torch.sign(base))
        ratio = torch.where(base != 0, a / base, torch.zeros_like(a))
        for q in range(a.shape[0]):
            nz = ratio[q][base[q] != 0]
            if nz.numel():
                assert torch.allclose(nz, nz[0].expand_as(nz), rtol=1e-9)
                assert (nz > 0).all()


@SETTINGS
@given(batches(nan=False), st.sampled_from(ALL), st.integers(1, 3))
def test_nan_padding_changes_nothing(rewards, name, extra):
    # extra all-NaN columns: every real sample's advantage is unchanged, the padding gets 0
    padded = torch.cat(
        [rewards, torch.full((rewards.shape[0], extra), math.nan, dtype=rewards.dtype)], 1
    )
    a = inputs.compute(name, rewards)
    b = inputs.compute(name, padded)
    assert torch.allclose(b.values[:, : rewards.shape[1]], a.values, atol=1e-12)
    assert (b.values[:, rewards.shape[1] :] == 0).all()


@SETTINGS
@given(batches(max_p=1, min_g=3, nan=False), st.sampled_from(GROUP_LOCAL), st.data())
def test_nan_entries_act_as_absent(rewards, name, data):
    # drop some entries (NaN) in a group: the others get what the compacted group gives them
    g = rewards.shape[1]
    drop = data.draw(st.lists(st.integers(0, g - 1), min_size=1, max_size=g - 1, unique=True))
    keep = [j for j in range(g) if j not in drop]
    holed = rewards.clone()
    holed[0, drop] = math.nan
    a = inputs.compute(name, holed).values
    b = inputs.compute(name, rewards[:, keep]).values
    assert torch.allclose(a[:, keep], b, atol=1e-12)
    assert (a[0, drop] == 0).all()


@SETTINGS
@given(batches(), st.sampled_from(ALL), st.sampled_from([0.5, 1.0, 2.0]))
def test_focal_is_one_scalar_per_group_in_0_1(rewards, name, gamma):
    base = inputs.compute(name, rewards).values
    foc = inputs.compute(name, rewards, focal_gamma=gamma).values
    ratio = torch.where(base != 0, foc / base, torch.full_like(base, math.nan))
    for q in range(base.shape[0]):
        r = ratio[q][~torch.isnan(ratio[q])]
        if r.numel():
            assert torch.allclose(r, r[0].expand_as(r), rtol=1e-9)
            assert 0 <= r[0] <= 1
