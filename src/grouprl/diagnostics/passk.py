"""Unbiased pass@k from n samples with c correct (Chen et al. 2021, "Evaluating LLMs on code")."""

from __future__ import annotations

import numpy as np

__all__ = ["pass_at_k"]


def pass_at_k(n, c, k: int):
    """Unbiased pass@k = 1 − C(n−c, k)/C(n, k), in the stable product form.

    Formula [PAPER: Chen et al. 2021, ALGORITHMS.md §5]: 1 − Π_{i=n−c+1}^{n} (1 − k/i), which is
    exactly 1 − C(n−c, k)/C(n, k) without huge binomials; it is 1 when n − c < k (every size-k
    subset holds a correct sample). Never "max over n samples", which is biased upwards.

    ``n`` and ``c`` are ints or array-likes (broadcast together; numpy in, numpy out); ``k`` is
    an int with 1 ≤ k ≤ n. Arrays are evaluated in log space, Σ log1p(−k/i), as differences of
    one cumulative sum, so a whole table costs O(max n). Raises ValueError on c > n, c < 0,
    k < 1 or k > n.
    """
    k = int(k)
    scalar = np.isscalar(n) and np.isscalar(c)
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64))
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if (c_arr < 0).any() or (c_arr > n_arr).any():
        raise ValueError("need 0 <= c <= n for every entry (c = correct samples of n)")
    if (n_arr < k).any():
        raise ValueError(f"need n >= k for every entry (k={k}); pass@k needs at least k samples")
    if scalar:
        nn, cc = int(n_arr), int(c_arr)
        if nn - cc < k:
            return 1.0
        prod = 1.0
        for i in range(nn - cc + 1, nn + 1):
            prod *= 1.0 - k / i
        return 1.0 - prod
    n_max = int(n_arr.max()) if n_arr.size else 0
    i = np.arange(1, n_max + 1, dtype=np.float64)
    terms = np.where(i > k, np.log1p(-k / np.maximum(i, k + 1)), 0.0)
    cum = np.concatenate([[0.0], np.cumsum(terms)])  # cum[m] = Σ_{i<=m} terms
    log_prod = cum[n_arr] - cum[n_arr - c_arr]
    out = -np.expm1(log_prod)
    return np.where(n_arr - c_arr < k, 1.0, out)
