"""Bounded-scale estimators: maxnorm_rloo, maxnorm_dr_grpo (MaxNorm-AC) and p90
(ALGORITHMS.md §1).

Each divides a trusted raw numerator ``u`` by one per-group scale card ``s_q``, so sign,
order and ratios of the advantages within a group are preserved. ``c = u / s_q`` is a plain
tensor computed from rewards: it is a constant in the loss by construction (the paper's
stop-gradient ``sg(c)``), and the KL term is not divided by ``s_q`` (``kl_weight = 1``).
"""

from __future__ import annotations

import torch

from grouprl.advantages._groups import DEFAULT_TAU, collapsed_mask, group_mean, group_std
from grouprl.advantages.baseline import DEFAULT_DDOF, _result
from grouprl.types import Advantages

DEFAULT_TAU_RES = 1e-2
"""Lower bound of the MaxNorm scale card, equal to the default resolution ``delta_res``
(MaxNorm paper: s_q = max(tau_res, ...), rewards in [0, 1]); 1/tau_res bounds the inverse scale."""


def _numerator(kind: str, rewards, valid, ddof, tau):
    n = valid.sum(dim=1)  # [P]
    mean = group_mean(rewards, valid)  # [P]
    std = group_std(rewards, valid, mean, ddof=ddof)  # [P]
    centred = rewards - mean[:, None]  # [P, G]
    if kind == "rloo":
        nf = n.to(rewards.dtype)
        centred = (nf / (nf - 1).clamp_min(1))[:, None] * centred
    u = torch.where(valid, centred, torch.zeros_like(centred))  # [P, G]
    return u, collapsed_mask(std, n, tau)


def _maxnorm(kind, rewards, valid, tau_res, ddof, tau):
    u, collapsed = _numerator(kind, rewards, valid, ddof, tau)  # [P, G], [P]
    s = u.abs().amax(dim=1).clamp_min(tau_res)  # [P]
    return _result(
        u / s[:, None], valid, collapsed, s, tau_res_bound_frac=_frac(s <= tau_res, collapsed)
    )


def _frac(mask: torch.Tensor, collapsed: torch.Tensor) -> float:
    live = ~collapsed
    return float((mask & live).sum() / live.sum().clamp_min(1))


def maxnorm_rloo(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    *,
    tau_res: float = DEFAULT_TAU_RES,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """MaxNorm-RLOO: u = r_i − mean_{j≠i} r_j, s_q = max(tau_res, max_j |u_j|), A = u / s_q.

    MaxNorm-AC (advantage scale calibration paper, seed text): |A| ≤ 1 with sign, order and
    ratios kept; 1/s_q ≤ 1/tau_res. ``stats["tau_res_bound_frac"]``: share of updated groups
    whose scale card sits at the floor tau_res.
    """
    return _maxnorm("rloo", rewards, valid, tau_res, ddof, tau)


def maxnorm_dr_grpo(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    *,
    tau_res: float = DEFAULT_TAU_RES,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """MaxNorm-Dr.GRPO: u = r_i − r̄_q, s_q = max(tau_res, max_j |u_j|), A = u / s_q.

    MaxNorm paper (seed text), with Dr.GRPO's numerator. |A| ≤ 1.
    """
    return _maxnorm("dr_grpo", rewards, valid, tau_res, ddof, tau)


def p90(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    *,
    quantile: float = 0.9,
    tau_res: float = DEFAULT_TAU_RES,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """P90: u = RLOO numerator, s_q = max(tau_res, P90_j |u_j|), A = u / s_q (|A| may exceed 1).

    [DIGEST]+[OURS] the MaxNorm paper's "percentile-scale robust reference": the quantile is
    taken over the group's valid |u_j| with linear interpolation (``torch.nanquantile``).
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    u, collapsed = _numerator("rloo", rewards, valid, ddof, tau)  # [P, G], [P]
    mags = torch.where(valid, u.abs(), torch.full_like(u, float("nan")))  # [P, G]
    q = torch.nanquantile(mags, quantile, dim=1).nan_to_num(0.0)  # [P]
    s = q.clamp_min(tau_res)  # [P]
    return _result(
        u / s[:, None], valid, collapsed, s, tau_res_bound_frac=_frac(s <= tau_res, collapsed)
    )
