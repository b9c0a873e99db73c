"""Plain per-group loop references for every estimator and transform (float64, no torch ops
inside the groups). Written independently of the vectorised code: lists and ``statistics``."""

from __future__ import annotations

import math

import numpy as np

TAU = 1e-6


def _std(xs, ddof):
    n = len(xs)
    if n <= ddof:
        return 0.0
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - ddof))


def _valid(row):
    return [(j, x) for j, x in enumerate(row) if not math.isnan(x)]


def _collapsed(xs, ddof, tau):
    return len(xs) < 2 or _std(xs, ddof) < tau


NEW = {
    "reinforce_pp_global",
    "flash_reinforce",
    "gdpo",
    "grpo_passk",
    "gpg",
    "opo",
    "remax",
}
"""The peers' estimators with a loop in :func:`per_group_new`."""

NO_GROUP_RULE = {"reinforce_pp_global", "flash_reinforce", "remax"}
"""Estimators without a group baseline: a collapsed group is not zeroed by a rule."""


def per_group(kind, rewards, *, eps=1e-6, ddof=1, tau=TAU, tau_res=1e-2, quantile=0.9, **inputs):  # noqa: C901 (one plain branch per estimator, on purpose)
    """Advantages [P][G] and scale [P] by a loop over groups."""
    if kind in NEW:
        return per_group_new(kind, rewards, ddof=ddof, tau=tau, **inputs)
    if kind == "reinforce_pp_baseline":
        kind = "reinforce_pp"  # the same estimator (reinforce_pp is its alias)
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    scales = np.zeros(rewards.shape[0])
    all_valid = [x for row in rewards for x in row if not math.isnan(x)]
    sigma_batch = _std(all_valid, ddof) + eps
    # batch-level quantities
    us = []
    for row in rewards:
        v = _valid(row)
        xs = [x for _, x in v]
        m = sum(xs) / len(xs) if xs else 0.0
        us += [x - m for x in xs]
    u_mu = sum(us) / len(us) if us else 0.0
    u_sigma = _std(us, ddof) + eps
    stds = [_std([x for _, x in _valid(row)], ddof) for row in rewards]
    live = [
        s for s, row in zip(stds, rewards) if not _collapsed([x for _, x in _valid(row)], ddof, tau)
    ]
    sigma_bar = sum(live) / len(live) if live else 0.0

    for p, row in enumerate(rewards):
        v = _valid(row)
        xs = [x for _, x in v]
        n = len(xs)
        m = sum(xs) / n if n else 0.0
        s = _std(xs, ddof)
        coll = _collapsed(xs, ddof, tau)
        if kind in ("grpo", "grpo_beta_comp"):
            scales[p] = s + eps
            vals = [(x - m) / (s + eps) for x in xs]
        elif kind == "dr_grpo":
            scales[p] = 1.0
            vals = [x - m for x in xs]
        elif kind == "rloo":
            scales[p] = 1.0
            vals = [x - (sum(xs) - x) / (n - 1) for x in xs] if n > 1 else [0.0] * n
        elif kind == "batch_std":
            scales[p] = sigma_batch
            vals = [(x - m) / sigma_batch for x in xs]
        elif kind == "reinforce_pp":
            scales[p] = u_sigma
            vals = [((x - m) - u_mu) / u_sigma for x in xs]
        elif kind == "gopo":
            scales[p] = 1.0
            vals = []
            for x in xs:
                rank = sum(1 for y in xs if y < x) + (sum(1 for y in xs if y == x) + 1) / 2
                vals.append((rank - (n + 1) / 2) / ((n - 1) / 2) if n > 1 else 0.0)
        elif kind in ("maxnorm_rloo", "maxnorm_dr_grpo", "p90"):
            if kind == "maxnorm_dr_grpo":
                u = [x - m for x in xs]
            else:
                u = [x - (sum(xs) - x) / (n - 1) for x in xs] if n > 1 else [0.0] * n
            mags = [abs(a) for a in u]
            if kind == "p90":
                card = float(np.quantile(mags, quantile)) if mags else 0.0
            else:
                card = max(mags) if mags else 0.0
            sq = max(tau_res, card)
            scales[p] = sq
            vals = [a / sq for a in u]
        elif kind == "sigma_weighted_grpo":
            w = s / sigma_bar if sigma_bar > 0 else 0.0
            scales[p] = (s + eps) / w if (not coll and w > 0) else s + eps
            vals = [w * (x - m) / (s + eps) for x in xs]
        else:
            raise KeyError(kind)
        if coll:
            vals = [0.0] * n
        for (j, _), a in zip(v, vals):
            out[p, j] = a
    return out, scales


def resolution(rewards, delta_res):
    rewards = np.asarray(rewards, dtype=np.float64)
    out = rewards.copy()
    keep = []
    for p, row in enumerate(rewards):
        v = sorted(_valid(row), key=lambda t: t[1])
        bins, cur = [], []
        for j, x in v:
            if cur and x - cur[-1][1] >= delta_res:
                bins.append(cur)
                cur = []
            cur.append((j, x))
        if cur:
            bins.append(cur)
        for b in bins:
            mean = sum(x for _, x in b) / len(b)
            for j, _ in b:
                out[p, j] = mean
        keep.append(len(bins) > 1 and len(v) > 1)
    return out, np.array(keep)


def focal(rewards, gamma, r_lo=0.0, r_hi=1.0):
    w = []
    for row in np.asarray(rewards, dtype=np.float64):
        xs = [x for _, x in _valid(row)]
        m = sum(xs) / len(xs) if xs else 0.0
        mu = min(1.0, max(0.0, (m - r_lo) / (r_hi - r_lo)))
        w.append((1 - mu) ** gamma)
    return np.array(w)


def symmetric_virtual(rewards, tau_adapt, alpha=0.5, r_lo=0.0, r_hi=1.0, ddof=1, tau=TAU):
    """Augmented rows (lists) for the symmetric mode, by a loop."""
    rows = [[x for _, x in _valid(row)] for row in np.asarray(rewards, dtype=np.float64)]
    g = len(rewards[0])
    collapsed = [len(xs) > 0 and _collapsed(xs, ddof, tau) for xs in rows]
    acr = sum(collapsed) / len(rows)
    k = max(1, min(g, math.ceil(g * acr**alpha - 1e-9)))
    out = []
    for xs, c in zip(rows, collapsed):
        extra = []
        if c and acr > tau_adapt:
            m = sum(xs) / len(xs)
            if m >= r_hi - 1e-6 * (r_hi - r_lo):
                extra = [r_hi - (r_hi - r_lo) * i / k for i in range(1, k + 1)]
            elif m <= r_lo + 1e-6 * (r_hi - r_lo):
                extra = [r_lo + (r_hi - r_lo) * i / k for i in range(1, k + 1)]
        out.append(extra)
    return out, k, acr


def _rows(rewards):
    return [[(j, x) for j, x in _valid(row)] for row in np.asarray(rewards, dtype=np.float64)]


def _whiten_list(xs, ddof, eps):
    mu = sum(xs) / len(xs) if xs else 0.0
    return mu, _std(xs, ddof) + eps


def per_group_new(kind, rewards, *, ddof=1, tau=TAU, lengths=None, baseline=None):  # noqa: C901
    """Loops for the peers' estimators at their default parameters."""
    rewards = np.asarray(rewards, dtype=np.float64)
    rows = _rows(rewards)
    out = np.zeros_like(rewards)
    scales = np.ones(rewards.shape[0])
    coll = [_collapsed([x for _, x in v], ddof, tau) for v in rows]
    flat = [x for v in rows for _, x in v]
    if kind == "reinforce_pp_global":
        mu, sig = _whiten_list(flat, ddof, 1e-6)
        for p, v in enumerate(rows):
            scales[p] = sig
            for j, x in v:
                out[p, j] = (x - mu) / sig
    elif kind == "flash_reinforce":
        mu = sum(flat) / len(flat) if flat else 0.0
        for p, v in enumerate(rows):
            for j, x in v:
                out[p, j] = x - mu
    elif kind == "gdpo":  # one reward function: group-normalise (eps 1e-4), then whiten
        normed = []
        for v, c in zip(rows, coll):
            xs = [x for _, x in v]
            m = sum(xs) / len(xs) if xs else 0.0
            s = _std(xs, ddof)
            normed.append([(j, 0.0 if c else (x - m) / (s + 1e-4)) for j, x in v])
        mu, sig = _whiten_list([a for v in normed for _, a in v], ddof, 1e-4)
        for p, (v, c) in enumerate(zip(normed, coll)):
            scales[p] = sig
            for j, a in v:
                out[p, j] = 0.0 if c else (a - mu) / sig
    elif kind == "grpo_passk":
        for p, (v, c) in enumerate(zip(rows, coll)):
            xs = [x for _, x in v]
            s = _std(xs, ddof)
            scales[p] = s + 1e-6
            if c:
                continue
            top = sorted(xs, reverse=True)
            if top[0] > top[1]:
                j = next(j for j, x in v if x == top[0])
                out[p, j] = (top[0] - top[1]) / (s + 1e-6)
    elif kind == "gpg":  # the paper's alpha = B / (B - M), F_norm = 1
        b = len(flat)
        m_inv = sum(len(v) for v, c in zip(rows, coll) if c)
        alpha = b / max(1, b - m_inv)
        for p, (v, c) in enumerate(zip(rows, coll)):
            scales[p] = 1.0 / alpha
            xs = [x for _, x in v]
            m = sum(xs) / len(xs) if xs else 0.0
            for j, x in v:
                out[p, j] = 0.0 if c else alpha * (x - m)
    elif kind == "opo":
        lengths = np.asarray(lengths, dtype=np.float64)
        for p, (v, c) in enumerate(zip(rows, coll)):
            if c:
                continue
            w = sum(lengths[p, j] for j, _ in v)
            b = sum(lengths[p, j] * x for j, x in v) / w
            for j, x in v:
                out[p, j] = x - b
    elif kind == "remax":
        for p, v in enumerate(rows):
            b = float(baseline[p])
            if math.isnan(b):
                continue
            for j, x in v:
                out[p, j] = x - b
    else:
        raise KeyError(kind)
    return out, scales
