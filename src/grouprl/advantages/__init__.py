"""Group-relative advantage estimators and the transforms that compose with them.

    from grouprl import advantages
    out = advantages.compute("maxnorm_rloo", rewards)     # rewards: float [P, G], NaN = missing
    out = advantages.compute("grpo", rewards, focal_gamma=0.5, delta_res=1e-2)
    out = advantages.compute("grpo", rewards, virtual="symmetric", trigger=VirtualTrigger())
    out.values, out.keep, out.kl_weight, out.scale, out.stats

Order of application (ALGORITHMS.md §2): resolution → virtual samples → estimator → focal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grouprl.advantages import baseline, ranking, scale, transforms
from grouprl.advantages._groups import (
    DEFAULT_TAU,
    check_positive,
    group_moments,
    shared_moments,
    validate_rewards,
)
from grouprl.advantages.transforms import (
    DEFAULT_DELTA_RES,
    VIRTUAL_MODES,
    VirtualTrigger,
    focal_weight,
    resolution,
    virtual_count,
    virtual_samples,
)
from grouprl.types import Advantages

__all__ = [
    "DEFAULT_DELTA_RES",
    "ESTIMATORS",
    "TRANSFORMS",
    "Advantages",
    "VirtualTrigger",
    "compute",
    "focal_weight",
    "group_std",
    "names",
    "resolution",
    "transforms",
    "virtual_count",
    "virtual_samples",
]

ESTIMATORS: dict[str, Callable[..., Advantages]] = {
    "grpo": baseline.grpo,
    "dr_grpo": baseline.dr_grpo,
    "rloo": baseline.rloo,
    "batch_std": baseline.batch_std,
    "reinforce_pp": baseline.reinforce_pp,
    "gopo": ranking.gopo,
    "p90": scale.p90,
    "maxnorm_rloo": scale.maxnorm_rloo,
    "maxnorm_dr_grpo": scale.maxnorm_dr_grpo,
    "grpo_beta_comp": baseline.grpo_beta_comp,
    "sigma_weighted_grpo": baseline.sigma_weighted_grpo,
}
"""Estimator name -> pure function ``(rewards [P, G], valid [P, G], **params) -> Advantages``."""

TRANSFORMS: dict[str, Callable[..., Any]] = {
    "delta_res": resolution,
    "virtual": virtual_samples,
    "focal_gamma": focal_weight,
}
"""Keyword of :func:`compute` -> the transform it switches on."""


def names() -> list[str]:
    """Every estimator name."""
    return list(ESTIMATORS)


def _estimator(name: str) -> Callable[..., Advantages]:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid estimators: {', '.join(ESTIMATORS)}"
        ) from None


def _check_params(fn: Callable[..., Advantages], name: str, params: dict[str, Any]) -> None:
    accepted = set(fn.__kwdefaults__ or {})
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(
            f"estimator {name!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
            f"{sorted(accepted)}, and compute() takes the transforms focal_gamma, delta_res, "
            "virtual (+ trigger, virtual_alpha) and reward_range"
        )
    if "eps" in params:  # 0 is fine: collapsed groups never reach the division
        check_positive("eps", params["eps"], allow_zero=True)
    for key in ("tau", "tau_res"):
        if key in params:
            check_positive(key, params[key])
    if "ddof" in params and params["ddof"] not in (0, 1):
        raise ValueError(
            f"ddof must be 0 (population std) or 1 (Bessel, TRL/verl), got {params['ddof']!r}"
        )


def _check_transforms(focal_gamma, delta_res, virtual, reward_range) -> tuple[float, float]:
    check_positive("focal_gamma", focal_gamma, allow_zero=True)
    if delta_res is not None:
        check_positive("delta_res", delta_res)
    if virtual is not None and virtual not in VIRTUAL_MODES:
        raise ValueError(
            f"unknown virtual mode {virtual!r}; valid modes: {', '.join(VIRTUAL_MODES)}"
        )
    try:
        r_lo, r_hi = (float(x) for x in reward_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"reward_range must be a pair (r_lo, r_hi), got {reward_range!r}"
        ) from None
    if not r_lo < r_hi:
        raise ValueError(f"reward_range must have r_lo < r_hi, got {reward_range!r}")
    return r_lo, r_hi


def compute(
    name: str,
    rewards: torch.Tensor,
    *,
    focal_gamma: float = 0.0,
    delta_res: float | None = None,
    virtual: str | None = None,
    trigger: VirtualTrigger | None = None,
    virtual_alpha: float = 0.5,
    virtual_batch_groups: int | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
    **params: Any,
) -> Advantages:
    """Advantages of estimator ``name`` for ``rewards [P, G]`` (NaN = missing), with transforms.

    Args:
        name: one of :func:`names`.
        rewards: float ``[P, G]``; NaN entries are excluded from every statistic and get 0.
        focal_gamma: F-GRPO focal exponent γ (0 = off; presets use 0.5).
        delta_res: MaxNorm resolution protocol bin width (None = off; paper 1e-2). Estimators
            with a scale floor (``tau_res``) default it to ``delta_res`` when it is set.
        virtual: AVSPO virtual samples, ``"symmetric" | "paper" | "code"`` (None = off).
        trigger: AVSPO's adaptive threshold state; read for the decision, then advanced once
            with this batch's ACR and mean reward. None: a fixed τ_adapt = 0.5.
        virtual_alpha: exponent α in K = ⌈G·ACR^α⌉ (ACR paper: 0.5).
        virtual_batch_groups: ``virtual="code"`` only: groups per generation batch whose
            rewards the code rule looks at together (None = the whole batch; the authors'
            script runs 1, see ``transforms.virtual_samples``).
        reward_range: ``(r_lo, r_hi)``, what "wrong" and "correct" are (default [0, 1]).
        **params: the estimator's own parameters (``eps``, ``ddof``, ``tau``, ``tau_res``...).
    """
    fn = _estimator(name)
    r_lo, r_hi = _check_transforms(focal_gamma, delta_res, virtual, reward_range)
    if delta_res is not None and "tau_res" in (fn.__kwdefaults__ or {}):
        params.setdefault("tau_res", delta_res)
    _check_params(fn, name, params)
    with shared_moments():  # the virtual trigger and the estimator share one pass
        return _compute(fn, rewards, focal_gamma, delta_res, virtual, trigger, virtual_alpha,
                        virtual_batch_groups, (r_lo, r_hi), params)  # fmt: skip


def _compute(
    fn: Callable[..., Advantages],
    rewards: torch.Tensor,
    focal_gamma: float,
    delta_res: float | None,
    virtual: str | None,
    trigger: VirtualTrigger | None,
    virtual_alpha: float,
    virtual_batch_groups: int | None,
    reward_range: tuple[float, float],
    params: dict[str, Any],
) -> Advantages:
    r_lo, r_hi = reward_range
    valid = validate_rewards(rewards)  # None: every reward valid (fast path)
    g = rewards.shape[1]
    nan_frac = 0.0 if valid is None else 1.0 - int(valid.count_nonzero()) / valid.numel()
    stats: dict[str, float] = {"nan_frac": nan_frac}
    keep = None  # [P] bool; None = every group kept

    # -- resolution: merge sub-resolution gaps, skip one-bin groups for both branches
    if delta_res is not None:
        rewards, keep = resolution(rewards, valid, delta_res)
        stats["resolution/skipped_frac"] = float((~keep).float().mean())

    # -- virtual samples: extra columns that enter the statistics only
    est_rewards, est_valid = rewards, valid
    if virtual is not None:
        tau_adapt = trigger.tau if trigger is not None else 0.5
        est_rewards, est_valid, vstats = virtual_samples(
            rewards,
            valid,
            mode=virtual,
            tau_adapt=tau_adapt,
            alpha=virtual_alpha,
            reward_range=(r_lo, r_hi),
            tau=params.get("tau", DEFAULT_TAU),
            ddof=params.get("ddof", 1),
            batch_groups=virtual_batch_groups,
        )
        stats.update(vstats)
        if trigger is not None:
            mean_reward = float(rewards.nanmean()) if nan_frac < 1 else 0.0
            stats["virtual/tau_adapt_next"] = trigger.update(vstats["virtual/acr"], mean_reward)

    # -- estimator
    out = fn(est_rewards, est_valid, **params)
    values = out.values[:, :g]  # [P, G] real samples only
    stats.update(out.stats)

    # -- focal weight: one scalar per group, from the real rewards
    if focal_gamma:
        weight = focal_weight(rewards, valid, focal_gamma, (r_lo, r_hi))  # [P]
        values = values * weight[:, None]
        stats["focal/mean_weight"] = float(weight.mean())

    updated = out.updated
    if keep is None:
        keep = out.keep
    else:
        values = values.masked_fill(~keep[:, None], 0.0)
        updated = updated & keep
    stats["updated_frac"] = float(updated.float().mean())
    return Advantages(values, keep, out.kl_weight, out.scale, stats, updated)


def group_std(rewards: torch.Tensor, *, ddof: int = 1) -> torch.Tensor:
    """``[P]`` std of each group's valid rewards (``ddof`` 1 as in §0); NaN with fewer than 2.

    The within-group reward std σ_q that GRPO divides by, as a plain statistic (no eps, no
    collapse threshold): what the IS-GRPO prompt sampler observes (``grouprl.sampling``).
    """
    valid = validate_rewards(rewards)
    m = group_moments(rewards, valid, ddof)
    return m.std.masked_fill(m.count < 2, float("nan"))
