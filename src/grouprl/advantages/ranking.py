"""Rank-based estimator: gopo (ALGORITHMS.md §1)."""

from __future__ import annotations

import torch

from grouprl.advantages._groups import (
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    column_range,
    group_moments,
    spread_collapsed,
    transposed,
    transposed_times,
    wrap_advantages,
    zero_where,
)
from grouprl.advantages.baseline import DEFAULT_DDOF
from grouprl.types import Advantages


def gopo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GOPO: centred within-group ranks scaled to [−1, 1]: (rank_i − (n+1)/2) / ((n−1)/2).

    Computed as Σ_j sign(r_i − r_j) / (n − 1), the same number without sorting
    (:func:`_column_sign_sums`).

    [OURS] from the "pure-ranking boundary baseline": rank_i = #{j: r_j < r_i} +
    (#{j: r_j = r_i} + 1)/2 over the group's n valid rewards (ties share their average
    rank), so the best sample gets +1 and the worst −1 when they are unique. Cardinal gaps
    are ignored entirely. A collapsed group (σ_q < tau) gets 0. scale = 1.
    """
    p, g = rewards.shape
    if g > SORT_NETWORK_MAX or valid is not None:
        m = group_moments(rewards, valid, ddof, tau)
        collapsed = m.collapsed
        factor = 1.0 / (m.count - 1).clamp_min(1).to(rewards.dtype)  # [P]
    else:  # only the collapse flag is needed: from the groups' ranges (no [P, G] moments)
        cols = transposed(rewards)  # [G, P]
        collapsed = spread_collapsed(rewards, *column_range(cols.unbind(0)), ddof, tau)
        # every group has n = G: the same float32 1/(G − 1) as the [P] division above
        one = 1.0 / torch.tensor([max(g - 1, 1)], dtype=rewards.dtype, device=rewards.device)
        factor = one.expand(p).clone()  # [P]
    factor = zero_where(factor, collapsed)  # [P]
    if g > SORT_NETWORK_MAX:
        values = _sign_sums(rewards, valid).mul_(factor[:, None])  # [P, G]
    else:  # scaled on the columns (a [P] factor per column, no [P, 1] broadcast), one copy back
        if valid is not None:
            cols = transposed(rewards)  # [G, P]
        values = transposed_times(_column_sign_sums(cols, valid is not None), factor)  # [P, G]
    # collapsed groups are now exactly 0
    ones = torch.ones(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)  # [P]
    return wrap_advantages(values, valid, collapsed, ones, zeroed=valid is None)


def _sign_sums(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[P, G]`` Σ_j sign(r_i − r_j) over each row (NaN pairs add 0); exact small integers.

    Centred average rank = (#below − #above)/2 = ½ Σ_j sign(r_i − r_j) (ties give 0). Up to
    :data:`SORT_NETWORK_MAX` samples, :func:`_column_sign_sums` on the columns; beyond, G
    passes over ``[P, G]``. A loop over the group *dimension*, never over groups or samples.
    """
    g = rewards.shape[1]
    if g <= SORT_NETWORK_MAX:
        return transposed(_column_sign_sums(transposed(rewards), valid is not None))
    total = torch.zeros_like(rewards)  # [P, G]
    step = torch.empty_like(rewards)  # [P, G], reused: fresh large tensors cost page faults
    for j in range(g):
        torch.sub(rewards, rewards[:, j : j + 1], out=step).sign_()
        total += step if valid is None else step.nan_to_num_(0.0)
    return total


def _column_sign_sums(cols: torch.Tensor, has_nan: bool) -> torch.Tensor:
    """``[G, P]`` Σ_j sign(c_i − c_j) for the G columns ``cols [G, P]`` of a batch (NaN adds 0).

    [OURS] Each unordered pair is compared once on contiguous ``[P]`` columns
    (sign(c_j − c_i) = −sign(c_i − c_j)): G(G−1)/2 pairs of column passes, ~9x faster than
    G passes over ``[P, G]`` at G = 8, and faster than the same pairs taken a distance at a
    time as ``[G − d, P]`` blocks (each a 4 MB pass at this size, out of cache).
    """
    g = cols.shape[0]
    col = cols.unbind(0)  # G x [P]
    total = torch.zeros_like(cols)  # [G, P]
    sums = total.unbind(0)  # G x [P] views: add_ in place (``total[i] +=`` would copy back)
    step = torch.empty_like(col[0])  # [P]
    for i in range(g):
        for j in range(i + 1, g):
            torch.sub(col[i], col[j], out=step).sign_()
            if has_nan:
                step.nan_to_num_(0.0)
            sums[i].add_(step)
            sums[j].sub_(step)
    return total
