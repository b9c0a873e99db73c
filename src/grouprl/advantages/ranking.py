"""Rank-based estimator: gopo (ALGORITHMS.md §1)."""

from __future__ import annotations

import torch

from grouprl.advantages._groups import DEFAULT_TAU, group_moments, wrap_advantages
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

    Computed as Σ_j sign(r_i − r_j) / (n − 1), the same number without sorting.

    [OURS] from the "pure-ranking boundary baseline": rank_i = #{j: r_j < r_i} +
    (#{j: r_j = r_i} + 1)/2 over the group's n valid rewards (ties share their average
    rank), so the best sample gets +1 and the worst −1 when they are unique. Cardinal gaps
    are ignored entirely. A collapsed group (σ_q < tau) gets 0. scale = 1.
    """
    m = group_moments(rewards, valid, ddof, tau)
    # centred average rank = (#below − #above)/2 = ½ Σ_j sign(r_i − r_j) (ties give 0), so
    # A_i = Σ_j sign(r_i − r_j) / (n − 1). G vectorised passes over the batch (a loop over the
    # group *dimension*, never over groups or samples); NaN pairs add 0.
    total = torch.zeros_like(rewards)  # [P, G]
    step = torch.empty_like(rewards)  # [P, G], reused: fresh large tensors cost page faults
    for j in range(rewards.shape[1]):
        torch.sub(rewards, rewards[:, j : j + 1], out=step).sign_()
        total += step if valid is None else step.nan_to_num_(0.0)
    factor = (1.0 / (m.count - 1).clamp_min(1).to(rewards.dtype)).masked_fill_(m.collapsed, 0.0)
    values = total.mul_(factor[:, None])  # [P, G]; collapsed groups are now exactly 0
    return wrap_advantages(values, valid, m.collapsed, torch.ones_like(m.std), zeroed=valid is None)
