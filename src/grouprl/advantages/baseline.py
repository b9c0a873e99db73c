"""Baseline-and-scale estimators: grpo, dr_grpo, rloo, batch_std, grpo_beta_comp,
sigma_weighted_grpo (ALGORITHMS.md §1). REINFORCE++ (batch whitening) is in ``global_norm.py``.

Every function maps ``rewards [P, G]`` (NaN = missing) and its validity mask (None = all
valid) to an :class:`~grouprl.types.Advantages`. Shared rules (§0): NaN entries are left out
of every statistic and get advantage 0; a group with σ_q < ``tau`` or fewer than 2 valid
rewards gets advantage exactly 0.
"""

from __future__ import annotations

import torch

from grouprl.advantages._groups import DEFAULT_TAU, group_moments, scale_dev, wrap_advantages
from grouprl.advantages._groups import batch_std as _batch_std
from grouprl.types import Advantages

GRPO_EPS = 1e-6
"""GRPO's std epsilon: 1e-6 as verl's ``compute_grpo_outcome_advantage`` (TRL uses 1e-4)."""

DEFAULT_DDOF = 1
"""Bessel-corrected std (``torch.std`` default) as TRL and verl use."""


def rloo_factor(count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[P]`` n/(n−1): turns r_i − r̄ into the leave-one-out r_i − mean_{j≠i} r_j (1 if n < 2)."""
    n = count.to(dtype)
    return n / (n - 1).clamp_min(1)


def grpo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GRPO: (r_i − r̄_q) / (σ_q + eps), σ with ``ddof`` (DeepSeekMath; verl, TRL).

    ``eps`` 1e-6 follows verl (TRL: 1e-4); ``ddof`` 1 both. scale = σ_q + eps.
    """
    m = group_moments(rewards, valid, ddof, tau)
    scale = m.std + eps  # [P]
    return wrap_advantages(scale_dev(m, 1.0 / scale), valid, m.collapsed, scale, zeroed=True)


def dr_grpo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """Dr.GRPO: r_i − r̄_q, no std division (Liu et al. 2025, "Understanding R1-Zero"). scale = 1.

    ``ddof`` only enters the collapse test σ_q < tau.
    """
    m = group_moments(rewards, valid, ddof, tau)
    return wrap_advantages(
        scale_dev(m, 1.0), valid, m.collapsed, torch.ones_like(m.mean), zeroed=True
    )


def rloo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """RLOO: r_i − mean_{j≠i} r_j = n/(n−1)·(r_i − r̄_q), n the valid count (verl, OpenRLHF).

    scale = 1 (ALGORITHMS.md §1). Groups with n < 2 get 0 (no leave-one-out baseline).
    """
    m = group_moments(rewards, valid, ddof, tau)
    values = scale_dev(m, rloo_factor(m.count, rewards.dtype))  # [P, G]
    return wrap_advantages(values, valid, m.collapsed, torch.ones_like(m.mean), zeroed=True)


def batch_std(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """Global normalisation: (r_i − r̄_q) / (σ_batch + eps), σ over every valid reward.

    TRL ``scale_rewards="batch"``. Collapsed groups (σ_q < tau) still get 0. scale = σ_batch + eps
    for every group.
    """
    m = group_moments(rewards, valid, ddof, tau)
    sigma = _batch_std(rewards, valid, ddof=ddof) + eps  # []
    values = scale_dev(m, 1.0 / sigma)  # [P, G]
    return wrap_advantages(values, valid, m.collapsed, sigma.expand_as(m.mean).clone(), zeroed=True)


def grpo_beta_comp(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GRPO advantages with kl_weight_q = 1/(σ_q + eps): KL rescaled like the reward branch.

    [OURS] from the MaxNorm paper's "GRPO+β_q-comp" baseline: the reward and KL branches keep
    their cardinal ratio, while the prompt weight 1/σ_q stays unbounded. A collapsed group
    keeps kl_weight = 1.
    """
    out = grpo(rewards, valid, eps=eps, ddof=ddof, tau=tau)
    collapsed = ~out.updated
    kl_weight = torch.where(collapsed, torch.ones_like(out.scale), 1.0 / out.scale)  # [P]
    return Advantages(out.values, out.keep, kl_weight, out.scale, out.stats, out.updated)


def sigma_weighted_grpo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GRPO re-weighted per prompt by σ_q/σ̄: (σ_q/σ̄)·(r_i − r̄_q)/(σ_q + eps).

    σ̄ = mean σ_q over the batch's non-collapsed groups. Up to eps this is (r_i − r̄_q)/σ̄:
    Dr.GRPO's direction with one per-batch scale (an adaptive optimizer largely removes it).
    [OURS] It is the *in-batch* reading of IS-GRPO ("Why GRPO needs normalization"): move the
    sampling density p_x ∝ σ_x into a weight on uniformly drawn prompts. It was this project's
    ``is_grpo`` estimator under an older name; the ``is_grpo`` preset now follows the paper's
    sampling reading (GRPO advantages, prompts drawn ∝ σ̂ by ``grouprl.sampling``). With no
    non-collapsed group every advantage is 0. scale = (σ_q + eps)·σ̄/σ_q.
    """
    m = group_moments(rewards, valid, ddof, tau)
    std, collapsed = m.std, m.collapsed
    live = (~collapsed).to(rewards.dtype)  # [P]
    sigma_bar = (std * live).sum() / live.sum().clamp_min(1)  # []
    weight = std / sigma_bar.clamp_min(torch.finfo(rewards.dtype).tiny)  # [P]
    values = scale_dev(m, weight / (std + eps))  # [P, G]
    scale = torch.where(collapsed, std + eps, (std + eps) / weight.clamp_min(1e-30))
    return wrap_advantages(values, valid, collapsed, scale, zeroed=True, sigma_bar=float(sigma_bar))
