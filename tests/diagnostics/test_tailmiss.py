"""Tail-miss and active probabilities: ALGORITHMS.md check values, identities, the advisor."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.diagnostics import advise_group_size, p_active, tail_miss_probability


@pytest.mark.parametrize(
    ("n", "want"), [(2, 0.45), (4, 0.711), (8, 0.658), (16, 0.440), (32, 0.194)]
)
def test_algorithms_md_check_values(n, want):
    # ALGORITHMS.md §5: μ = 0.5, τ = 0.05 (3 decimals there).
    assert tail_miss_probability(0.5, 0.05, n) == pytest.approx(want, abs=5e-4)


def test_exact_small_n():
    # N = 2, μ = 0.5, τ = 0.05: 0.95² − 0.45² − 0.5² = 0.9025 − 0.2025 − 0.25 = 0.45 exactly.
    assert tail_miss_probability(0.5, 0.05, 2) == pytest.approx(0.45, abs=1e-15)
    # N = 3, μ = 0.3, τ = 0.1: 0.9³ − 0.2³ − 0.7³ = 0.729 − 0.008 − 0.343 = 0.378.
    assert tail_miss_probability(0.3, 0.1, 3) == pytest.approx(0.378, abs=1e-15)
    assert p_active(0.5, 2) == pytest.approx(0.5, abs=1e-15)
    assert p_active(0.25, 3) == pytest.approx(1 - 0.25**3 - 0.75**3, abs=1e-15)


def test_more_check_values_and_peak():
    # Peak of the μ = 0.5, τ = 0.05 curve over integers: f(4) = 0.711 > f(3), f(5).
    ns = np.arange(1, 65)
    f = tail_miss_probability(0.5, 0.05, ns)
    assert f[0] == 0.0 and int(ns[np.argmax(f)]) == 5
    # Hand: N=5: 0.95^5 − 0.45^5 − 0.5^5 = 0.7737809375 − 0.0184528125 − 0.03125 = 0.724078125.
    assert f[4] == pytest.approx(0.724078125, abs=1e-12)
    assert (np.diff(f[4:]) < 0).all() and (np.diff(f[:5]) > 0).all()


def test_broadcasting_numpy_and_torch():
    mu = np.array([0.2, 0.5, 0.9])[:, None]
    n = np.array([1, 2, 8, 32])[None, :]
    out = tail_miss_probability(mu, 0.1 * mu, n)
    assert out.shape == (3, 4)
    loop = [
        [(1 - 0.1 * m) ** k - (0.9 * m) ** k - (1 - m) ** k for k in (1, 2, 8, 32)]
        for m in (0.2, 0.5, 0.9)
    ]
    np.testing.assert_allclose(out, np.clip(loop, 0, 1), rtol=0, atol=1e-15)
    t = tail_miss_probability(torch.tensor([0.5]), torch.tensor([0.05]), torch.tensor([[2], [4]]))
    assert isinstance(t, torch.Tensor) and t.shape == (2, 1) and t.dtype == torch.float64
    assert t[1, 0].item() == pytest.approx(0.711, abs=5e-4)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1), st.integers(1, 200))
def test_identities(mu, frac, n):
    tau = frac * mu
    tm = tail_miss_probability(mu, tau, n)
    act = p_active(mu, n)
    # A tail miss is an active group: 0 ≤ P(miss) ≤ P(active) ≤ 1; τ = 0 gives P(active).
    assert 0.0 <= tm <= act + 1e-12 <= 1.0 + 1e-12
    assert tail_miss_probability(mu, 0.0, n) == pytest.approx(act, abs=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="tau"):
        tail_miss_probability(0.3, 0.5, 4)
    with pytest.raises(ValueError, match="positive integer"):
        tail_miss_probability(0.3, 0.1, 2.5)
    with pytest.raises(ValueError, match="mu"):
        p_active(1.5, 4)


def test_advisor_recommends_smallest_qualifying_n():
    # All prompts at μ = 0.5, ρ = 0.1 -> τ = 0.05: active(N) = 1 − 2·0.5^N and the tail-miss
    # values above. With min_active 0.9 and max_tail_miss 0.25: N=4 active 0.875 (too low),
    # N=8 active 0.992 but miss 0.658, N=16 miss 0.440, N=32 miss 0.194 -> 32.
    adv = advise_group_size([0.5] * 10, 0.1, min_active=0.9, max_tail_miss=0.25)
    assert adv.recommended == 32 and "smallest N" in adv.reason
    assert adv.active[adv.candidates.index(4)] == pytest.approx(0.875, abs=1e-12)
    # Looser tail-miss target -> the smaller N = 8 suffices.
    assert advise_group_size([0.5] * 10, 0.1, min_active=0.9, max_tail_miss=0.7).recommended == 8


def test_advisor_fallback_explains():
    # Prompts at μ = 0.01: at most 1 − 0.99^8 − 0.01^8 = 7.7 % of groups of 8 are active; the
    # target drops to 0.9·7.7 % = 6.9 %, which only N = 8 reaches (N = 4: 3.9 %); its tail miss
    # with τ = 0.005 is 0.995^8 − 0.005^8 − 0.99^8 = 0.038 <= 0.25.
    adv = advise_group_size([0.01] * 5, 0.5, candidates=(2, 4, 8), min_active=0.99)
    assert adv.recommended == 8 and "at most 8%" in adv.reason and "avspo" in adv.reason
    assert adv.tail_miss[-1] == pytest.approx(0.995**8 - 0.005**8 - 0.99**8, abs=1e-12)
    # Tail miss above target everywhere the target is reached -> focal pointer.
    adv = advise_group_size([0.5] * 4, 0.1, candidates=(4, 8), min_active=0.8, max_tail_miss=0.1)
    # N = 4 already reaches active 0.875 >= 0.8 (tail miss 0.711): smallest such N, plus the pointer.
    assert adv.recommended == 4 and "focal_gamma" in adv.reason
    with pytest.raises(ValueError, match="empty"):
        advise_group_size([])
