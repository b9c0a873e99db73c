"""Advantage-collapse rate (ACR) of a reward batch, with its all-correct / all-wrong split.

ALGORITHMS.md §5 [PAPER: "Advantage Collapse in GRPO"]: a group is *collapsed* when the std of
its valid rewards is below ``tau`` (never ``σ == 0``: float32 noise). A collapsed group gives
every estimator that subtracts a group baseline a zero advantage, so its rollouts are wasted.
"""

from __future__ import annotations

import torch

from grouprl.advantages._groups import DEFAULT_TAU, group_moments, validate_rewards

__all__ = ["DEFAULT_TAU", "acr", "collapse_split"]

CORRECT_ATOL = 1e-6
"""How close a collapsed group's mean must be to r_hi / r_lo to count as all-correct /
all-wrong [OURS]; rewards in [0, 1] from a binary verifier are exact, so 1e-6 is slack only."""


def collapse_split(
    rewards: torch.Tensor,
    *,
    tau: float = DEFAULT_TAU,
    reward_range: tuple[float, float] = (0.0, 1.0),
    ddof: int = 1,
    atol: float = CORRECT_ATOL,
) -> dict[str, torch.Tensor]:
    """Per-group collapse flags: ``[P]`` bool tensors keyed by kind.

    Keys:
        ``collapsed``: σ_q < tau, σ over the valid (non-NaN) rewards with ``ddof`` (1 = Bessel,
            as TRL/verl), or fewer than 2 valid rewards (ALGORITHMS.md §0: it gets advantage
            0). The same statistics as the estimators (``advantages._groups.group_moments``).
        ``all_correct``: collapsed, at least one valid reward, mean within ``atol`` of r_hi.
        ``all_wrong``: collapsed, at least one valid reward, mean within ``atol`` of r_lo.
        ``other``: collapsed but neither (constant partial credit, or no valid reward at all).
        ``insufficient``: fewer than 2 valid rewards (subset of collapsed; NaN-dominated).
        ``sigma``: ``[P]`` float, σ_q itself (for the normalisation-regime statistics).

    Edge cases: NaN rewards are excluded, never read as 0; ±inf raises ValueError.
    """
    valid = validate_rewards(rewards)  # [P, G] or None when every reward is valid
    r_lo, r_hi = float(reward_range[0]), float(reward_range[1])
    if not r_hi > r_lo:
        raise ValueError(f"reward_range must be (r_lo, r_hi) with r_hi > r_lo, got {reward_range}")
    m = group_moments(rewards, valid, ddof, tau)  # the estimators' own statistics
    n, mean, sigma, collapsed = m.count, m.mean, m.std, m.collapsed  # [P] each
    has_any = n >= 1  # [P]
    all_correct = collapsed & has_any & ((mean - r_hi).abs() <= atol)
    all_wrong = collapsed & has_any & ((mean - r_lo).abs() <= atol)
    other = collapsed & ~all_correct & ~all_wrong
    return {
        "collapsed": collapsed,
        "all_correct": all_correct,
        "all_wrong": all_wrong,
        "other": other,
        "insufficient": n < 2,
        "sigma": sigma,
    }


def acr(rewards: torch.Tensor, tau: float = DEFAULT_TAU, *, ddof: int = 1) -> float:
    """Advantage-collapse rate: the fraction of groups whose reward std is below ``tau``.

    ACR = (1/P) Σ_q 1[σ_q < tau] [PAPER: ACR paper, ALGORITHMS.md §5]. NaN rewards are left out
    of σ_q; a group with < 2 valid rewards counts as collapsed (it cannot produce a signal).
    """
    return float(collapse_split(rewards, tau=tau, ddof=ddof)["collapsed"].double().mean())
