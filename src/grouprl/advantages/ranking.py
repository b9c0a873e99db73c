"""Rank-based estimator: gopo (ALGORITHMS.md §1)."""

from __future__ import annotations

import torch

from grouprl.advantages._groups import (
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    group_moments,
    transposed,
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
    (:func:`_sign_sums`).

    [OURS] from the "pure-ranking boundary baseline": rank_i = #{j: r_j < r_i} +
    (#{j: r_j = r_i} + 1)/2 over the group's n valid rewards (ties share their average
    rank), so the best sample gets +1 and the worst −1 when they are unique. Cardinal gaps
    are ignored entirely. A collapsed group (σ_q < tau) gets 0. scale = 1.
    """
    m = group_moments(rewards, valid, ddof, tau)
    factor = zero_where(1.0 / (m.count - 1).clamp_min(1).to(rewards.dtype), m.collapsed)  # [P]
    total = _sign_sums(rewards, valid)  # [P, G]
    values = total.mul_(factor[:, None])  # [P, G]; collapsed groups are now exactly 0
    return wrap_advantages(values, valid, m.collapsed, torch.ones_like(m.std), zeroed=valid is None)


def _sign_sums(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[P, G]`` Σ_j sign(r_i − r_j) over each row (NaN pairs add 0); exact small integers.

    Centred average rank = (#below − #above)/2 = ½ Σ_j sign(r_i − r_j) (ties give 0). Each
    unordered pair is compared once on contiguous ``[P]`` columns (sign(r_j − r_i) =
    −sign(r_i − r_j)): G(G−1)/2 pairs of column passes, ~9x faster than G passes over
    ``[P, G]`` at G = 8; from :data:`SORT_NETWORK_MAX` on, the G passes over ``[P, G]``.
    A loop over the group *dimension*, never over groups or samples.
    """
    g = rewards.shape[1]
    if g > SORT_NETWORK_MAX:
        total = torch.zeros_like(rewards)  # [P, G]
        step = torch.empty_like(rewards)  # [P, G], reused: fresh large tensors cost page faults
        for j in range(g):
            torch.sub(rewards, rewards[:, j : j + 1], out=step).sign_()
            total += step if valid is None else step.nan_to_num_(0.0)
        return total
    cols = transposed(rewards).unbind(0)  # G x [P]
    total = torch.zeros((g, rewards.shape[0]), dtype=rewards.dtype, device=rewards.device)
    sums = total.unbind(0)  # G x [P] views: add_ in place (``total[i] +=`` would copy back)
    step = torch.empty_like(cols[0])  # [P]
    for i in range(g):
        for j in range(i + 1, g):
            torch.sub(cols[i], cols[j], out=step).sign_()
            if valid is not None:
                step.nan_to_num_(0.0)
            sums[i].add_(step)
            sums[j].sub_(step)
    return transposed(total)
