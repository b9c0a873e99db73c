"""The advantage layer's fast paths against the implementations they replaced.

Each ``old_*`` function below is the previous implementation, kept here as the reference:
the new code must give the same bits (``torch.equal``: same values, NaN where NaN) on random
batches with NaN entries, ties, collapsed and empty groups, at several group sizes, both
sides of ``SORT_NETWORK_MAX``. The sorting network is checked by the 0-1 principle.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from grouprl import advantages
from grouprl.advantages import _groups, ranking, scale, transforms
from grouprl.types import Advantages


def batch(p: int, g: int, seed: int, nan: float = 0.0) -> torch.Tensor:
    """Binary, 5-level, continuous and sub-resolution rows; constant, singleton, empty rows."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 4, (p, 1), generator=gen)
    binary = torch.randint(0, 2, (p, g), generator=gen).float()
    levels = torch.randint(0, 5, (p, g), generator=gen).float() / 4
    cont = torch.rand(p, g, generator=gen)
    jitter = 0.5 + 1e-3 * torch.rand(p, g, generator=gen)
    r = torch.where(
        kind == 0, binary, torch.where(kind == 1, levels, torch.where(kind == 2, cont, jitter))
    )
    r[0], r[1] = 1.0, 0.0
    if nan:
        r[torch.rand(p, g, generator=gen) < nan] = math.nan
        r[2, 1:] = math.nan  # singleton
        r[3] = math.nan  # empty
    return r


# ---- the replaced implementations (the plain forms) -----------------------------


def old_sign_sums(rewards, valid):
    total = torch.zeros_like(rewards)
    step = torch.empty_like(rewards)
    for j in range(rewards.shape[1]):
        torch.sub(rewards, rewards[:, j : j + 1], out=step).sign_()
        total += step if valid is None else step.nan_to_num_(0.0)
    return total


def old_row_quantile(x, valid, count, q):
    keyed = x if valid is None else x.masked_fill(~valid, float("inf"))
    ordered = keyed.sort(dim=1).values
    pos = q * (count - 1).clamp_min(0).to(x.dtype)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (count - 1).clamp_min(0))
    a = ordered.gather(1, lo[:, None]).squeeze(1)
    b = ordered.gather(1, hi[:, None]).squeeze(1)
    out = a + (pos - lo.to(x.dtype)) * (b - a)
    return out.masked_fill(count == 0, 0.0)


def old_resolution(rewards, valid, delta_res):
    p, g = rewards.shape
    sorted_r, order = torch.sort(rewards, dim=1)
    sorted_valid = torch.gather(valid, 1, order)
    gaps = sorted_r[:, 1:] - sorted_r[:, :-1]
    new_bin = (gaps >= delta_res) & sorted_valid[:, 1:]
    bin_id = torch.cat([torch.zeros_like(new_bin[:, :1]), new_bin], 1).long().cumsum(1)
    flat = bin_id + torch.arange(p)[:, None] * g
    w = sorted_valid.to(rewards.dtype)
    filled = torch.where(sorted_valid, sorted_r, torch.zeros_like(sorted_r))
    sums = torch.zeros(p * g, dtype=rewards.dtype)
    counts = torch.zeros(p * g, dtype=rewards.dtype)
    sums.scatter_add_(0, flat.reshape(-1), filled.reshape(-1))
    counts.scatter_add_(0, flat.reshape(-1), w.reshape(-1))
    means = (sums / counts.clamp_min(1)).reshape(p * g)[flat]
    binned_sorted = torch.where(sorted_valid, means, sorted_r)
    binned = torch.empty_like(rewards).scatter_(1, order, binned_sorted)
    n_bins = (bin_id * sorted_valid).amax(dim=1) + 1
    return binned, (n_bins > 1) & (valid.sum(dim=1) > 1)


def old_code_trigger(rewards, valid, r_lo, r_hi, atol, width):
    p = rewards.shape[0]
    ok = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    lo = ((rewards <= r_lo + atol) | ~ok).all(1)
    hi = ((rewards >= r_hi - atol) | ~ok).all(1) & ok.any(1)
    batch = torch.arange(p) // width
    ones = torch.ones(int(batch[-1]) + 1, dtype=torch.long)
    size = torch.zeros_like(ones).index_add_(0, batch, torch.ones_like(batch))
    batch_lo = torch.zeros_like(ones).index_add_(0, batch, lo.long()) == size
    batch_hi = torch.zeros_like(ones).index_add_(0, batch, hi.long()) == size
    batch_hi &= ~batch_lo
    return (batch_lo | batch_hi)[batch], torch.where(batch_lo[batch], r_hi, r_lo).to(rewards.dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and NaN at the same places (torch.equal treats NaN as unequal)."""
    return (
        a.shape == b.shape
        and torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


GROUPS = [1, 2, 3, 5, 8, 16, 33]  # 33: beyond SORT_NETWORK_MAX, the torch.sort branch
DTYPES = [torch.float32, torch.float64]


# ---- the sorting network ---------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 13))
def test_merge_network_sorts_every_0_1_input(n):
    # Knuth's 0-1 principle (TAOCP vol. 3, §5.3.4, exercise 5.3.4-11): a comparator network
    # sorts every input iff it sorts all 2^n sequences of zeros and ones.
    cols = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n))).t().contiguous()  # [n, 2^n]
    out, _ = _groups.sort_columns(list(cols.unbind(0)))
    assert torch.equal(torch.stack(out), cols.sort(dim=0).values)
    assert all(a < b < n for a, b in _groups.merge_network(n))


def test_merge_network_sizes():
    # Batcher's odd-even merge sort: 19 compare-exchanges for 8 inputs, 63 for 16
    assert len(_groups.merge_network(8)) == 19 and len(_groups.merge_network(16)) == 63


@pytest.mark.parametrize("g", [2, 5, 8, 13])
def test_sort_columns_carries_the_positions(g):
    x = batch(300, g, seed=g)
    idx = torch.arange(g, dtype=torch.uint8)[:, None].expand(g, 300)
    vals, order = _groups.sort_columns(list(x.t().unbind(0)), list(idx.unbind(0)))
    vals, order = torch.stack(vals), torch.stack(order).long()  # [G, P]
    assert torch.equal(vals, x.t().sort(dim=0).values)
    assert torch.equal(x.t().gather(0, order), vals)  # each slot names where its value was
    assert torch.equal(order.sort(dim=0).values, torch.arange(g)[:, None].expand(g, 300))


# ---- exact selects -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_and_zero_where_are_torch_where_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=gen).to(dtype)
    b = torch.randn(1000, generator=gen).to(dtype)
    a[:4] = torch.tensor([-0.0, math.nan, math.inf, -math.inf], dtype=dtype)
    b[4:8] = torch.tensor([-0.0, math.nan, math.inf, -math.inf], dtype=dtype)
    cond = torch.rand(1000, generator=gen) < 0.5
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    assert torch.equal(_groups.select(cond, a, b).view(bits), torch.where(cond, a, b).view(bits))
    assert torch.equal(
        _groups.select(cond, a, 2.5).view(bits), torch.where(cond, a, 2.5).view(bits)
    )
    zeroed = _groups.zero_where(a.clone(), cond)
    assert torch.equal(zeroed.view(bits), a.masked_fill(cond, 0.0).view(bits))  # +0.0, not -0.0
    # broadcasting, other dtypes: torch's own kernels
    assert same(_groups.select(cond[:1], a, b), torch.where(cond[:1], a, b))


def test_transposed_is_the_transpose():
    for x in (batch(50, 8, 0), batch(50, 1, 0), batch(50, 8, 1)[:1]):
        for t in (x, x.double(), x.half()):
            y = _groups.transposed(t)
            assert y.is_contiguous() and torch.equal(y, t.t())
            y.fill_(7.0)  # a copy, also where x.t() is already contiguous
            assert not (t == 7.0).any()


# ---- the estimators and transforms, old vs new -----------------------------------------------


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("nan", [0.0, 0.2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gopo_sign_sums_equal_the_g_pass_loop(g, nan, dtype):
    r = batch(200, g, seed=10 + g, nan=nan).to(dtype)
    valid = _groups.validate_rewards(r)
    assert same(ranking._sign_sums(r, valid), old_sign_sums(r, valid))


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("nan", [0.0, 0.2])
@pytest.mark.parametrize("q", [0.9, 0.5, 1.0, 0.01])
def test_row_quantile_equals_the_sort(g, nan, q):
    r = batch(200, g, seed=20 + g, nan=nan)
    valid = _groups.validate_rewards(r)
    count = _groups.group_count(valid, r)
    x = (r - r.nanmean(1, keepdim=True)).abs()
    assert same(scale._row_quantile(x, valid, count, q), old_row_quantile(x, valid, count, q))


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("nan", [0.0, 0.2])
@pytest.mark.parametrize("delta", [1e-2, 0.3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_resolution_equals_the_sort(g, nan, delta, dtype):
    r = batch(200, g, seed=30 + g, nan=nan).to(dtype)
    r[5] = torch.tensor([-0.0, 0.0] * g)[:g].to(dtype)  # signed zeros: one bin
    valid = _groups.validate_rewards(r)
    binned, keep = transforms.resolution(r, valid, delta)
    if g == 1:  # the old code failed on one sample per group; one sample is one bin
        assert same(binned, r) and not keep.any()
        return
    ref_binned, ref_keep = old_resolution(r, _groups.dense_valid(r, valid), delta)
    assert same(binned, ref_binned) and torch.equal(keep, ref_keep)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 200, 1000])
@pytest.mark.parametrize("nan", [0.0, 0.3])
def test_code_trigger_equals_the_row_rule(width, nan):
    r = batch(200, 4, seed=width, nan=nan)
    r[42:84] = 0.0  # all-wrong batches at the small widths
    r[84:112] = 1.0  # all-correct ones
    r[85, 1:] = math.nan  # an all-correct group with NaN entries
    r[100] = math.nan  # an empty group inside the all-correct run
    valid = _groups.validate_rewards(r)
    got = transforms._code_trigger(r, valid, 0.0, 1.0, 1e-6, width)
    want = old_code_trigger(r, valid, 0.0, 1.0, 1e-6, width)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].any() or width >= 200  # the planted batches fire at small widths
    for one in (torch.zeros(6, 3), torch.ones(6, 3)):  # every batch fires, each direction
        got = transforms._code_trigger(one, None, 0.0, 1.0, 1e-6, width)
        assert torch.equal(got[0], old_code_trigger(one, None, 0.0, 1.0, 1e-6, width)[0])
        assert got[0].all() and torch.equal(got[1], 1.0 - one[:, 0])


# ---- the shared moments -------------------------------------------------------------------


def test_shared_moments_compute_once_and_hand_out_fresh_dev(monkeypatch):
    r = batch(100, 8, 1)
    calls = []
    real = _groups._moments
    monkeypatch.setattr(_groups, "_moments", lambda *a: calls.append(1) or real(*a))
    with _groups.shared_moments():
        a = _groups.group_moments(r, None)
        a.dev.mul_(0.0)  # an estimator changes its dev in place
        b = _groups.group_moments(r, None)
        c = _groups.group_moments(r, None, ddof=0)  # other parameters: computed again
        r2 = r.clone()
        d = _groups.group_moments(r2, None)  # another tensor: computed again
        r2.add_(1.0)  # changed in place: its version moves on, computed again
        e = _groups.group_moments(r2, None)
    assert len(calls) == 4
    fresh = real(r, None, 1, _groups.DEFAULT_TAU)
    assert torch.equal(b.dev, fresh.dev) and torch.equal(b.std, fresh.std)
    assert torch.equal(d.mean, fresh.mean) and torch.equal(e.mean, real(r2, None, 1, 1e-6).mean)
    assert not torch.equal(c.std, fresh.std)
    _groups.group_moments(r, None)
    assert len(calls) == 5  # outside the block nothing is kept


@pytest.mark.parametrize("virtual", ["symmetric", "paper", "code"])
def test_virtual_path_equals_the_estimator_on_the_augmented_batch(virtual):
    # compute() with the shared moments == the transform and the estimator run separately
    r = batch(64, 8, 3, nan=0.1)
    r[:40] = 1.0  # ACR above the trigger: the virtual columns are added
    for rewards in (r, batch(64, 8, 4)):
        out = advantages.compute("grpo", rewards, virtual=virtual)
        valid = _groups.validate_rewards(rewards)
        aug, aug_valid, _ = transforms.virtual_samples(rewards, valid, mode=virtual)
        ref = advantages.ESTIMATORS["grpo"](aug, aug_valid)
        assert torch.equal(out.values, ref.values[:, :8]) and torch.equal(out.scale, ref.scale)


def test_validation_with_nan_still_finds_inf_and_allows_huge_values():
    r = batch(10, 4, 0, nan=0.2)
    r[5, 0] = math.inf
    with pytest.raises(ValueError, match="infinite"):
        advantages.compute("grpo", r)
    huge = batch(10, 4, 0, nan=0.2)
    huge[huge == huge] = 3e38  # finite; its nansum overflows to inf
    out = advantages.compute("dr_grpo", huge)
    assert out.stats["nan_frac"] > 0 and torch.isfinite(out.values).all()


# ---- collapse flags from ranges, top two, blocked network, plain resolution rows -------------


def planted(g: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`batch` with rows that decide the shortcuts: constants of values whose multiples
    are exact (0, 1, 0.5, -0.0) and of one whose are not (1000.1: its computed σ is 6.5e-5,
    so the moments call it live), near-ties around tau, huge and tiny values."""
    r = batch(64, g, seed=90 + g).to(dtype)
    rows = [
        [0.0] * g,
        [1.0] * g,
        [0.5] * g,
        [-0.0, 0.0] * g,
        [1000.1] * g,
        [0.1] * g,
        [3.0] * g,
        [2.0**126] * g,  # nice bits, but 8 of them overflow
        [1e-40] * g,  # subnormal in float32
        [1.0 + 3e-7 * (i % 2) for i in range(g)],  # spread near the bound
        [1.0 + 1e-6 * i for i in range(g)],
        [5.0 + 4e-7 * i for i in range(g)],
    ]
    for i, row in enumerate(rows):
        r[4 + i] = torch.tensor(row[:g], dtype=torch.float64).to(dtype)
    return r


@pytest.mark.parametrize("g", [1, 2, 3, 5, 8, 16, 33])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_spread_collapsed_is_the_moments_flag(g, ddof, dtype):
    r = planted(g, dtype)
    want = _groups.group_moments(r, None, ddof).collapsed
    lo, hi = _groups.column_range(_groups.transposed(r).unbind(0))
    assert torch.equal(_groups.spread_collapsed(r, lo, hi, ddof, _groups.DEFAULT_TAU), want)
    for tau in (0.0, 1e-3, 10.0):  # no shortcut at tau = 0, many unsure groups at 10
        want = _groups.group_moments(r, None, ddof, tau).collapsed
        assert torch.equal(_groups.spread_collapsed(r, lo, hi, ddof, tau), want)


def test_spread_collapsed_catches_a_wrong_exact_multiple(monkeypatch):
    # planted bug: calling every constant group's multiples exact makes 1000.1's group
    # collapsed, which its moments say it is not (σ = 6.5e-5 from the mean's rounding)
    r = planted(8, torch.float32)
    want = _groups.group_moments(r, None, 1).collapsed
    assert not want[8]  # the 1000.1 row: live by the moments
    monkeypatch.setattr(_groups, "_exact_multiples", lambda v, g: v == v)  # all True
    lo, hi = _groups.column_range(_groups.transposed(r).unbind(0))
    assert not torch.equal(_groups.spread_collapsed(r, lo, hi, 1, _groups.DEFAULT_TAU), want)


def test_exact_multiples_by_hand():
    v = torch.tensor([0.0, -0.0, 1.0, 0.5, 3.0, 0.75, 0.1, 1000.1, 2.0**120, 1e-40, -2.0])
    want = [True, True, True, True, True, True, False, False, False, False, True]
    assert _groups._exact_multiples(v, 8).tolist() == want
    assert _groups._exact_multiples(v.numpy(), 8).tolist() == want  # the host arrays' path
    v64 = [0.0, -0.0, 1.0, 0.5, 3.0, 0.75, 0.1, 1000.1, 1e-320, 2.0**-1000, -2.0]
    v64 = torch.tensor(v64, dtype=torch.float64)
    want64 = [*want[:-3], False, False, True]  # 1e-320 subnormal, 2^-1000 below 2^-100
    assert _groups._exact_multiples(v64, 8).tolist() == want64
    assert _groups._exact_multiples(v64.numpy(), 8).tolist() == want64
    assert _groups._exact_multiples(torch.tensor([1.0 + 2.0**-20]), 8).tolist() == [True]
    assert _groups._exact_multiples(torch.tensor([1.0 + 2.0**-21]), 8).tolist() == [False]
    assert _groups._exact_multiples(torch.tensor([1.0 + 2.0**-21]), 4).tolist() == [True]


@pytest.mark.parametrize("g", [2, 3, 5, 8, 16])
def test_top_two_and_column_range_equal_the_sort(g):
    x = batch(300, g, seed=40 + g).abs()  # ties: binary and 5-level rows
    ordered = x.sort(dim=1).values
    second, first = _groups.top_two(x.t().contiguous().unbind(0))
    assert torch.equal(first, ordered[:, -1]) and torch.equal(second, ordered[:, -2])
    lo, hi = _groups.column_range(x.t().contiguous().unbind(0))
    assert torch.equal(lo, ordered[:, 0]) and torch.equal(hi, ordered[:, -1])


@pytest.mark.parametrize("n", range(1, 13))
def test_network_blocks_are_the_network_and_sort_every_0_1_input(n):
    cols = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n))).t().contiguous()  # [n, 2^n]
    w = cols.clone()
    pairs = []
    for a, b in transforms.network_blocks(n):
        ia, ib = range(n)[a], range(n)[b]
        assert len(ia) == len(ib) and len(set(ia) | set(ib)) == 2 * len(ia)  # disjoint pairs
        pairs += zip(ia, ib)
        lo = torch.minimum(w[a], w[b])
        w[b] = torch.maximum(w[a], w[b])
        w[a] = lo
    assert torch.equal(w, cols.sort(dim=0).values)
    assert sorted(pairs) == sorted(_groups.merge_network(n))


@pytest.mark.parametrize("g", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_resolution_plain_rows_and_exact_rows_equal_the_sort(g, dtype):
    r = planted(g, dtype)
    r[20] = torch.tensor(([0.25] * 3 + [0.75] * 5) * g, dtype=dtype)[:g]  # nice repeats
    r[21] = torch.tensor(([0.1] * 3 + [0.9] * 5) * g, dtype=dtype)[:g]  # 0.1 x 3: not nice
    binned, keep = transforms.resolution(r, None, 1e-2)
    ref_binned, ref_keep = old_resolution(r, _groups.dense_valid(r, None), 1e-2)
    assert same(binned, ref_binned) and torch.equal(keep, ref_keep)
    rest = transforms._two_level(
        _groups.transposed(r).numpy(), np.empty(r.shape[0], dtype=bool), 1e-2
    )
    exact = torch.zeros(r.shape[0], dtype=torch.bool)
    exact[torch.from_numpy(rest)] = True
    assert not exact[[4, 5, 6, 20]].any()  # 0, 1, 0.5 constants and nice repeats: no bin means
    assert exact[11]  # 2^126 repeated: the exact path
    if g >= 3:  # 1000.1 and 0.1 three times or more: their sums round, so the exact path
        assert exact[8] and exact[21]


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_level_edges_equal_the_sort(dtype):
    # two levels exactly delta_res apart (2^-7: every float here exact) are two bins; a huge
    # negative level repeated overflows in the sort's ascending sum (-inf), as a positive one
    big = 2.0**126 if dtype == torch.float32 else 2.0**1022
    rows = [
        [0.25, 0.2578125, 0.25, 0.2578125, 0.25],  # gap exactly 2^-7: two bins, nice levels
        [0.25, 0.25, 0.2578125 - 2.0**-12, 0.25, 0.25],  # gap just below: one bin
        [-big, -big, -big, -big, -big],  # -4·big overflows: the exact path's -inf, not -big
        [-big, 0.0, -big, -big, -big],
        [big, 0.0, big, big, big],
        [-0.0, 0.5, -0.0, 0.5, 0.5],
    ]
    r = torch.tensor(rows, dtype=dtype)
    binned, keep = transforms.resolution(r, None, 2.0**-7)
    ref_binned, ref_keep = old_resolution(r, _groups.dense_valid(r, None), 2.0**-7)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    assert torch.equal(binned.view(bits), ref_binned.view(bits))
    assert keep.tolist() == ref_keep.tolist() == [True, False, False, True, True, True]
    assert torch.isinf(binned[2:5]).any(dim=1).tolist() == [True, True, True]


def test_resolution_plain_path_catches_overflowing_repeats(monkeypatch):
    # planted bug: without the huge-value guard, 8 x 2^126 (nice bits) would be plain and
    # keep 2^126, where its bin sum overflows to inf in the sort's ascending sum
    r = planted(8, torch.float32)
    ref_binned, _ = old_resolution(r, _groups.dense_valid(r, None), 1e-2)
    assert torch.isinf(ref_binned[11]).all()
    monkeypatch.setattr(transforms, "_HUGE", math.inf)
    binned, _ = transforms.resolution(r, None, 1e-2)
    assert not same(binned, ref_binned)


def test_zero_rows_is_masked_fill_bit_for_bit():
    v = torch.randn(500, 8)
    v[::7] = -0.0
    rows = torch.rand(500, generator=torch.Generator().manual_seed(3)) < 0.3
    want = v.masked_fill(rows[:, None], 0.0)
    assert torch.equal(
        _groups.zero_rows_(v.clone(), rows).view(torch.int32), want.view(torch.int32)
    )


@pytest.mark.parametrize("g", [1, 2, 5, 8, 16])
def test_gopo_and_gdpo_flags_equal_the_moments(g):
    # gopo and gdpo take their collapse flag from ranges: the same flag as the moments,
    # seen in ``updated`` and the stats (the 1000.1 row: values 0, yet updated)
    r = planted(g, torch.float32)
    m = _groups.group_moments(r, None, 1)
    out = ranking.gopo(r, None)
    assert torch.equal(out.updated, ~m.collapsed)
    factor = (1.0 / torch.tensor(float(max(g - 1, 1)))).expand(r.shape[0]).clone()
    want = old_sign_sums(r, None).mul_(factor.masked_fill(m.collapsed, 0.0)[:, None])
    assert same(out.values, want)
    x = advantages.combine.normalize_then_sum(r.unsqueeze(-1))
    flag = _groups.group_moments(x, None, 1).collapsed
    got = advantages.global_norm.gdpo(x, None)
    assert torch.equal(got.updated, ~flag) and got.stats["collapsed_frac"] == float(
        flag.float().mean()
    )


def old_maxnorm(r, kind="rloo", tau_res=1e-2, ddof=1, tau=_groups.DEFAULT_TAU):
    """The row form: full moments, aminmax of the centred rewards, the card and the division."""
    m = _groups._moments(r, None, ddof, tau)
    n = m.count.to(r.dtype)
    factor = n / (n - 1).clamp_min(1) if kind == "rloo" else torch.ones_like(m.mean)
    lo, hi = torch.aminmax(m.dev, dim=1)
    s = (torch.maximum(hi, -lo) * factor).clamp_min(tau_res)
    values = m.dev * (factor / s).masked_fill(m.collapsed, 0.0)[:, None]
    return values, s, m.collapsed


def two_level_batch(g, dtype):
    """Two-level rows (0/1, nice and non-nice levels, gaps exactly delta_res, below it, -0,
    huge) beside continuous and planted rows."""
    r = planted(g, dtype)
    gen = torch.Generator().manual_seed(7 + g)
    lo = torch.tensor([0.0, 0.25, 0.1, -0.0, 0.5, 2.0**101, 0.3], dtype=dtype)
    hi = torch.tensor([1.0, 0.26, 0.11, 1.0, 0.5, 2.0**101 + 2.0**80, 0.3], dtype=dtype)
    hi[2] = lo[2] + torch.tensor(1e-2, dtype=dtype)  # a gap of exactly delta_res (in dtype)
    for i in range(len(lo)):
        pick = torch.rand(g, generator=gen) < 0.5
        r[30 + i] = torch.where(pick, hi[i], lo[i])
    r[40, 0] = -0.0
    return r


@pytest.mark.parametrize("g", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_level_resolution_and_column_maxnorm_equal_the_row_forms(g, dtype):
    r = two_level_batch(g, dtype)
    binned, keep = transforms.resolution(r, None, 1e-2)
    ref_binned, ref_keep = old_resolution(r, _groups.dense_valid(r, None), 1e-2)
    assert same(binned, ref_binned) and torch.equal(keep, ref_keep)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    for kind, fn in (("rloo", scale.maxnorm_rloo), ("dr_grpo", scale.maxnorm_dr_grpo)):
        values, s, collapsed = old_maxnorm(ref_binned, kind)
        out = fn(ref_binned, None)
        assert torch.equal(out.values.view(bits), values.view(bits))  # signed zeros too
        assert same(out.scale, s) and torch.equal(out.updated, ~collapsed)
        assert out.stats["collapsed_frac"] == float(collapsed.float().mean())
    out = advantages.compute("maxnorm_rloo", r, delta_res=1e-2)
    values, s, collapsed = old_maxnorm(ref_binned)
    values = values.masked_fill(~ref_keep[:, None], 0.0)
    assert torch.equal(out.values.view(bits), values.view(bits)) and torch.equal(out.keep, ref_keep)


def test_resolution_stats_by_hand():
    # G = 4, delta_res = 0.01, tau_res = 0.5, worked by hand (maxnorm_rloo: u = 4/3 (r - mean),
    # card = max |u|, the floor share over the groups that are not collapsed after binning)
    r = torch.tensor(
        [
            [0.0, 0.0, 1.0, 1.0],  # two bins; card 4/3 * 0.5 = 0.667 > 0.5
            [0.5, 0.5, 0.5, 0.5],  # one bin: skipped, collapsed
            [0.3, 0.302, 0.304, 0.9],  # bins {0.3, 0.302, 0.304} and {0.9}: card ~0.598
            [0.1, 0.1, 0.1, 0.105],  # a gap of 0.005: one bin, skipped, collapsed
            [0.2, 0.2, 0.2, 0.2075],  # one bin, skipped, collapsed
            [0.0, 0.0, 0.0, 0.2],  # two bins; card 4/3 * 0.15 = 0.2 <= 0.5: at the floor
        ]
    )
    out = advantages.compute("maxnorm_rloo", r, delta_res=0.01, tau_res=0.5)
    assert out.keep.tolist() == [True, False, True, False, False, True]
    assert out.stats["resolution/skipped_frac"] == 0.5
    assert out.stats["collapsed_frac"] == 0.5  # the binned rewards' groups, all six counted
    assert out.stats["tau_res_bound_frac"] == pytest.approx(1 / 3)  # g5 of g0, g2, g5
    assert out.stats["updated_frac"] == 0.5
    assert torch.equal(out.values[[1, 3, 4]], torch.zeros(3, 4))
    bin_mean = (0.3 + 0.302 + 0.304) / 3  # in float32 below
    binned = torch.tensor([bin_mean] * 3 + [0.9])
    u = (binned - binned.mean()) * 4 / 3
    assert torch.allclose(out.values[2], u / u.abs().max(), atol=1e-6)
    assert torch.allclose(out.values[5], torch.tensor([-0.05, -0.05, -0.05, 0.15]) * 4 / 3 / 0.5)


@pytest.mark.parametrize("name", ["maxnorm_rloo", "grpo", "rloo", "p90", "gopo"])
@pytest.mark.parametrize("g", [3, 5, 8])
def test_compute_with_resolution_is_the_estimator_on_contiguous_binned_rows(name, g):
    # the resolution's binned columns go to the column estimators with the binned rows, the
    # others get the rows alone: either way the same bits as the estimator on the binned rows
    r = batch(400, g, seed=g)
    binned, keep = transforms.resolution(r, None, 1e-2)
    assert binned.is_contiguous()
    out = advantages.compute(name, r, delta_res=1e-2)
    kw = {"tau_res": 1e-2} if name.startswith("maxnorm") else {}
    ref = advantages.ESTIMATORS[name](binned, None, **kw)
    want = ref.values.masked_fill(~keep[:, None], 0.0)
    assert torch.equal(out.values.view(torch.int32), want.contiguous().view(torch.int32))
    assert out.stats["collapsed_frac"] == ref.stats["collapsed_frac"]


def test_two_level_binned_negative_zero_is_positive_zero():
    # the sort's bin sums start from +0: a -0 reward of a two-level group bins to +0 (bits)
    r = torch.tensor([[-0.0, 1.0, -0.0, 1.0], [1.0, -0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    binned, keep = transforms.resolution(r, None, 1e-2)
    assert not binned.signbit().any() and keep.all()
    ref, _ = old_resolution(r, _groups.dense_valid(r, None), 1e-2)
    assert torch.equal(binned.view(torch.int32), ref.view(torch.int32))


def test_floor_share_leaves_out_collapsed_groups_above_the_floor():
    # tau = 2, tau_res = 3 (G = 4, RLOO factor 4/3), worked by hand:
    # [0, 0, 4, 4]: sigma 2.31 live, card 4/3 * 2 = 2.67 <= 3: at the floor
    # [0, 0, 0, 10]: sigma 5 live, card 10 > 3
    # [0, 0, 0, 3.5]: sigma 1.75 < 2 collapsed, card 3.5 > 3: not a live group, not counted
    r = torch.tensor([[0.0, 0.0, 4.0, 4.0], [0.0, 0.0, 0.0, 10.0], [0.0, 0.0, 0.0, 3.5]])
    out = scale.maxnorm_rloo(r, None, tau=2.0, tau_res=3.0)
    assert out.updated.tolist() == [True, True, False]
    assert out.stats["tau_res_bound_frac"] == 0.5
    assert out.stats["collapsed_frac"] == pytest.approx(1 / 3)


@pytest.mark.usefixtures("clean_registry")
def test_resolution_skip_never_writes_into_an_estimators_kept_memory():
    # an estimator that hands out memory it keeps (a cache): compute() zeroes the skipped
    # groups in a copy, so the cache is the same after the call
    cache = torch.tensor([[1.0, -1.0], [2.0, -2.0]])

    def cached(rewards, valid):
        ones = rewards.new_ones(rewards.shape[0])
        return Advantages(cache, ones.bool(), ones, ones)

    advantages.register_estimator("cached_for_test", cached)
    r = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    out = advantages.compute("cached_for_test", r, delta_res=1e-2)
    assert out.values.tolist() == [[1.0, -1.0], [0.0, 0.0]]
    assert cache.tolist() == [[1.0, -1.0], [2.0, -2.0]]


def test_two_level_leaves_the_columns_plus_zero():
    # the columns handed to the estimator are the transpose of the binned rewards: -0 is +0
    r = torch.tensor([[-0.0, 1.0, -0.0, 1.0], [0.3, -0.0, 0.7, 0.2]])
    cols = _groups.transposed(r)
    transforms._two_level(cols.numpy(), np.empty(2, dtype=bool), 1e-2)
    assert torch.equal(cols.view(torch.int32), (r + 0.0).t().contiguous().view(torch.int32))


# ---- grpo_passk and normalize_then_sum without NaN -----------------------------------------------


@pytest.mark.parametrize("g", [2, 3, 8, 17, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_passk_on_columns_equals_the_masked_path(g, dtype, norm_by_std):
    # the masked path (argmax and scatter on rows, the moments' σ) with a mask of all True:
    # the same best sample, the same zeros and collapse flags; σ within a few ulps
    r = batch(400, g, seed=70 + g).to(dtype)
    r[2] = -0.0  # a constant group of -0
    r[3] = 0.0
    r[3, 0] = -0.0  # ±0 tie at the top: every sample 0
    fast = advantages.reweighted.grpo_passk(r, None, norm_by_std=norm_by_std)
    slow = advantages.reweighted.grpo_passk(
        r, torch.ones_like(r, dtype=torch.bool), norm_by_std=norm_by_std
    )
    assert torch.equal(fast.values != 0, slow.values != 0)
    assert torch.equal(fast.updated, slow.updated)
    assert fast.stats == pytest.approx(slow.stats)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fast.values, slow.values, rtol=rtol, atol=0)
    torch.testing.assert_close(fast.scale, slow.scale, rtol=rtol, atol=0)
    assert (fast.values.view(_groups._INT_OF[dtype]) >= 0).all()  # +0 and gaps, never -0
    if not norm_by_std:  # no σ: the same bits
        assert torch.equal(fast.values, slow.values)


@pytest.mark.parametrize("g", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("ddof", [0, 1])
def test_column_std_is_the_moments_std(g, ddof):
    r = batch(500, g, seed=90 + g).double() * 3.0 - 1.0
    want = _groups.group_moments(r, None, ddof).std
    got = _groups.column_std(r.t().contiguous().unbind(0), ddof)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    by_hand = [
        math.sqrt(sum((v - sum(row) / g) ** 2 for v in row) / max(1, g - ddof)) if g > ddof else 0.0
        for row in r[:5].tolist()
    ]
    assert got[:5].tolist() == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("weights", [None, [0.5, 2.0, 1.0]])
def test_normalize_then_sum_without_nan_equals_its_nan_path(k, weights):
    # the NaN path (the moments of one [P·K, G] permutation) on the same groups plus one
    # with a NaN: within the rounding of the column sums, the same collapsed functions
    from grouprl.advantages import combine

    w = None if weights is None else weights[:k]
    gen = torch.Generator().manual_seed(k)
    r = torch.stack([batch(40_000, 8, seed=10 * k + j) for j in range(k)], -1)
    r[5, :, 0] = 0.25  # a collapsed function in one group
    if k > 1:
        r[5, :, 1] = torch.arange(8.0) / 8  # beside one that is not
    fast = combine.normalize_then_sum(r, w)
    holed = torch.cat([r, torch.rand(1, 8, k, generator=gen)])
    holed[-1, 0, 0] = math.nan
    slow = combine.normalize_then_sum(holed, w)[:-1]
    torch.testing.assert_close(fast, slow, rtol=2e-6, atol=2e-6)
    if k == 1:  # a collapsed function adds exactly 0: the flag is the moments' bits
        assert torch.equal(fast == 0, slow == 0)
    assert (fast[5].abs().sum() > 0) == (k > 1)  # the other function still counts there


@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 17) + 3, 3 * (1 << 17), 1_000_003])
def test_sum_squares_is_the_float64_sum_within_float32_rounding(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) + 0.5
    want = float((x.double() ** 2).sum())
    got = _groups.sum_squares(x.view(-1, 1) if n % 2 else x)  # any shape
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(want, rel=1e-6, abs=1e-30)


def test_gdpo_through_compute_reads_the_columns_normalize_then_sum_hands_over():
    # compute() hands the first stage's columns to the second (no transpose); the result is
    # the two stages called apart to the bit, collapsed groups (every function constant)
    # and a group collapsed in one function only included
    from grouprl.advantages import combine, global_norm

    r = torch.stack([batch(3000, 8, seed=5), batch(3000, 8, seed=6)], -1)
    r[7] = 0.75  # every function constant: the sum is 0, the group collapsed
    r[8, :, 0] = 0.5  # one function constant
    got = advantages.compute("gdpo", r)
    want = global_norm.gdpo(combine.normalize_then_sum(r), None)
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.updated, want.updated) and not got.updated[7] and got.updated[8]
    assert got.stats["collapsed_frac"] == want.stats["collapsed_frac"] > 0


@pytest.mark.parametrize("name", ["grpo", "gdpo"])
def test_rewards_with_a_graph_give_constants_and_plain_ones_are_not_copied(name):
    from grouprl.advantages import _constant

    r = torch.rand(16, 4, 2 if name == "gdpo" else 1).squeeze(-1).requires_grad_()
    out = advantages.compute(name, r)
    assert not out.values.requires_grad  # stop-gradient: no graph reaches the rewards
    plain = r.detach()
    assert _constant(plain) is plain and _constant(r) is not r
    assert not _constant(r).requires_grad
    # the column paths write in place: a graph-carrying input takes the general path
    if name == "gdpo":
        from grouprl.advantages import combine

        got = combine.normalize_then_sum(r)  # (its statistics are in place: no backward)
        want = combine.normalize_then_sum(r.detach())
        torch.testing.assert_close(got.detach(), want, rtol=2e-6, atol=2e-6)
    else:
        got = advantages.reweighted.grpo_passk(r, None)
        assert torch.equal(got.values, advantages.reweighted.grpo_passk(r.detach(), None).values)


@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_transposed_times_is_the_product_transposed(g, dtype):
    gen = torch.Generator().manual_seed(g)
    cols = torch.randn(g, 1000, generator=gen).to(dtype)
    cols[0, :3] = torch.tensor([-0.0, math.inf, 2.0**-140])
    factor = torch.randn(1000, generator=gen).to(dtype)
    factor[:2] = torch.tensor([0.0, -0.0])
    before = cols.clone()
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
    want = (cols * factor).t().contiguous()  # the product, then the copy: NaN from inf * 0
    got = _groups.transposed_times(cols, factor)
    assert got.shape == (1000, g) and got.is_contiguous()
    assert torch.equal(got.view(bits[dtype]), want.view(bits[dtype]))
    plain = _groups.transposed_times(cols, None)
    assert torch.equal(plain.view(bits[dtype]), cols.t().contiguous().view(bits[dtype]))
    assert torch.equal(cols.view(bits[dtype]), before.view(bits[dtype]))  # left as it was


@pytest.mark.parametrize("name", ["maxnorm_rloo", "gopo", "grpo_passk", "grpo", "p90", "gdpo"])
def test_extreme_rewards_take_the_host_paths_without_warnings(name):
    # spreads that overflow float32 (hi − lo = inf) in the numpy bookkeeping are IEEE results,
    # as in torch: no RuntimeWarning (the suite turns warnings into errors)
    r = torch.tensor([[-3e38, 3e38, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.5] * 4])
    out = advantages.compute(name, r)
    assert out.values.shape == (3, 4) and torch.equal(out.values[2], torch.zeros(4))
    if name not in ("gdpo",):
        binned = advantages.compute(name, r, delta_res=1e-2)
        assert binned.keep.tolist() == [True, True, False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_mean_is_the_rows_mean_bit_for_bit(dtype):
    # torch's own mean(1) of contiguous rows, for every group size up to the sorting network's
    # and batches of one row to many: uniform values of mixed scales (any other order of
    # additions rounds differently), -0 rows, sums that overflow, tiny values
    gen = torch.Generator().manual_seed(5)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    for g in range(1, _groups.SORT_NETWORK_MAX + 1):
        for p in (1, 3, 1000):
            scale = torch.tensor([1.0, 7.0, 1e4, 1e-3], dtype=torch.float64)
            pick = torch.randint(0, 4, (p, g), generator=gen)
            r = torch.rand(p, g, generator=gen, dtype=torch.float64).mul_(scale[pick]).to(dtype)
            if p > 3:
                r[0], r[1], r[2, ::2] = -0.0, torch.finfo(dtype).tiny, torch.finfo(dtype).max
            got = _groups.column_mean(r.t().contiguous())
            if got is None:  # an order the probe could not reproduce: the caller's rows
                assert torch.backends.cpu.get_cpu_capability() not in VERIFIED_ORDERS, (g, p)
                continue
            assert torch.equal(got.view(bits), r.mean(1).view(bits)), (g, p)
    big = batch(131_072, 8, seed=3).to(dtype)
    got = _groups.column_mean(big.t().contiguous())
    assert got is None or torch.equal(got.view(bits), big.mean(1).view(bits))


VERIFIED_ORDERS = ("AVX2", "DEFAULT")
"""torch CPU capabilities on which column_mean's order was checked for every G <= 32 (the
other ones, AVX-512 among them, rely on the probe: a width that reproduces torch or None)."""


def test_column_mean_refuses_an_order_it_cannot_reproduce(monkeypatch):
    # planted bug: a plain running sum over the columns is torch's order at G = 8 (width 8)
    # but not at G = 12; the probe must see that and hand the caller None, never wrong floats
    def running(cols, width):
        total = np.zeros_like(cols[0])
        for c in cols:
            total += c
        return total

    _groups._summation_width.cache_clear()
    monkeypatch.setattr(_groups, "_torch_order_sum", running)
    try:
        assert _groups._summation_width(torch.float32, 12) is None
        assert _groups.column_mean(torch.rand(12, 50)) is None
        assert _groups._summation_width(torch.float32, 3) is not None  # the same order there
    finally:
        _groups._summation_width.cache_clear()
    assert _groups.column_mean(torch.rand(12, 50, dtype=torch.float16)) is None  # not handled


@pytest.mark.parametrize("slice_groups", [1, 7, 64])
@pytest.mark.parametrize("with_nan", [False, True])
def test_resolution_in_slices_equals_the_sort(monkeypatch, slice_groups, with_nan):
    # the column passes run the batch in slices of _SLICE groups (uneven last ones too):
    # each group's bins are its own, so any slicing gives the sort's bits
    monkeypatch.setattr(transforms, "_SLICE", slice_groups)
    r = two_level_batch(8, torch.float32)
    if with_nan:
        r[torch.rand(r.shape, generator=torch.Generator().manual_seed(9)) < 0.1] = math.nan
    valid = _groups.validate_rewards(r)
    binned, keep = transforms.resolution(r, valid, 1e-2)
    ref_binned, ref_keep = old_resolution(r, _groups.dense_valid(r, valid), 1e-2)
    assert same(binned, ref_binned) and torch.equal(keep, ref_keep)
    if not with_nan:  # the plain groups found in slices are those found in one pass
        cols, keep = _groups.transposed(r).numpy(), np.zeros(r.shape[0], dtype=bool)
        rest = transforms._two_level(cols, keep, 1e-2)
        monkeypatch.setattr(transforms, "_SLICE", 1 << 20)
        cols1, keep1 = _groups.transposed(r).numpy(), np.zeros(r.shape[0], dtype=bool)
        rest1 = transforms._two_level(cols1, keep1, 1e-2)
        plain = np.setdiff1d(np.arange(r.shape[0]), rest1)
        assert np.array_equal(rest, rest1) and np.array_equal(keep[plain], keep1[plain])
        assert np.array_equal(cols.view(np.int32), cols1.view(np.int32))


def test_resolution_takes_the_plain_first_columns_up_to_the_network(monkeypatch):
    # CPU float groups of 2 .. SORT_NETWORK_MAX without NaN take the two-level shortcut first;
    # beyond the network, other dtypes and with NaN: the sort or the exact columns
    seen = []
    real = transforms._resolution_plain_first
    monkeypatch.setattr(
        transforms, "_resolution_plain_first", lambda r, d: seen.append(r.shape[1]) or real(r, d)
    )
    for g in (1, 2, _groups.SORT_NETWORK_MAX, _groups.SORT_NETWORK_MAX + 1):
        transforms.resolution(torch.rand(5, g), None, 1e-2)
    transforms.resolution(torch.rand(5, 8).to(torch.bfloat16), None, 1e-2)
    assert seen == [2, _groups.SORT_NETWORK_MAX]


def test_resolution_of_rewards_that_carry_a_graph_is_the_constants_binning():
    # numpy cannot hold a tensor with a graph: such rewards take the sort, the same bins
    r = two_level_batch(8, torch.float32)
    binned, keep = transforms.resolution(r.clone().requires_grad_(), None, 1e-2)
    want, want_keep = transforms.resolution(r, None, 1e-2)
    assert torch.equal(binned.detach().view(torch.int32), want.view(torch.int32))
    assert torch.equal(keep, want_keep)
    cols = r.t().contiguous().requires_grad_()
    assert _groups.column_mean(cols) is None  # the caller takes the rows' mean
    got = _groups.transposed_times(cols, torch.full((r.shape[0],), 2.0))
    assert torch.equal(got.detach(), (r * 2.0))
