"""Rank-based estimator: gopo (ALGORITHMS.md §1)."""

from __future__ import annotations

import torch

from grouprl.advantages._groups import DEFAULT_TAU, collapsed_mask, group_std
from grouprl.advantages.baseline import DEFAULT_DDOF, _result
from grouprl.types import Advantages


def gopo(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    *,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GOPO: centred within-group ranks scaled to [−1, 1]: (rank_i − (n+1)/2) / ((n−1)/2).

    [OURS] from the "pure-ranking boundary baseline": rank_i = #{j: r_j < r_i} +
    (#{j: r_j = r_i} + 1)/2 over the group's n valid rewards (ties share their average
    rank), so the best sample gets +1 and the worst −1 when they are unique. Cardinal gaps
    are ignored entirely. A collapsed group (σ_q < tau) gets 0. scale = 1.
    """
    n = valid.sum(dim=1)  # [P]
    std = group_std(rewards, valid, ddof=ddof)  # [P]
    collapsed = collapsed_mask(std, n, tau)
    ri, rj = rewards[:, :, None], rewards[:, None, :]  # [P, G, 1], [P, 1, G]
    vj = valid[:, None, :]  # [P, 1, G]
    below = ((rj < ri) & vj).sum(dim=2).to(rewards.dtype)  # [P, G]
    equal = ((rj == ri) & vj).sum(dim=2).to(rewards.dtype)  # [P, G] (counts itself)
    rank = below + (equal + 1) / 2  # [P, G], 1-based
    nf = n.to(rewards.dtype)[:, None]  # [P, 1]
    values = (rank - (nf + 1) / 2) / ((nf - 1) / 2).clamp_min(0.5)  # [P, G]
    return _result(values, valid, collapsed, torch.ones_like(std))
