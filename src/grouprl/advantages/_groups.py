"""Masked per-group statistics shared by every estimator. All functions are pure and batched.

A reward tensor is ``[P, G]`` with NaN for missing entries; ``valid`` is its ``[P, G]`` mask.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from grouprl.types import Advantages

DEFAULT_TAU = 1e-6
"""Collapse threshold on σ_q (ALGORITHMS.md §0, ACR paper): never test σ == 0."""


def keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The keyword-only parameters of an estimator (or combination) and their defaults,
    through any ``functools.wraps`` wrapper (``inspect.unwrap``): a wrapped estimator (a
    decorator, mutation testing's trampolines, scripts/mutation.sh) keeps its parameters."""
    return dict(inspect.unwrap(fn).__kwdefaults__ or {})


def validate_rewards(rewards: torch.Tensor) -> torch.Tensor | None:
    """Check a reward batch; return its ``[P, G]`` validity mask (True = not NaN), or None when
    every reward is valid (the fast path every estimator takes).

    Raises ValueError for anything but a non-empty 2-D floating tensor without ±inf.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(
            f"rewards must be a torch.Tensor of shape [P, G], got {type(rewards).__name__}; "
            "wrap it with torch.as_tensor(rewards, dtype=torch.float32)"
        )
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be 2-D [P prompts, G samples], got shape {tuple(rewards.shape)}; "
            "reshape a flat batch with rewards.view(-1, group_size)"
        )
    if not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be floating point (NaN marks a missing reward), got {rewards.dtype}; "
            "use rewards.float()"
        )
    if rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)}): nothing to estimate")
    if bool(torch.isfinite(rewards.sum())):  # one reduction: no NaN, no inf (fast path)
        return None
    if torch.isinf(rewards).any():
        n = int(torch.isinf(rewards).sum())
        raise ValueError(
            f"rewards contains {n} infinite value(s); a verifier should return a finite "
            "score, or NaN when it cannot score (NaN is excluded and counted)"
        )
    return ~torch.isnan(rewards)


def dense_valid(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[P, G]`` validity mask, materialised when ``valid`` is None (every reward valid)."""
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    return valid


def group_count(valid: torch.Tensor | None, rewards: torch.Tensor) -> torch.Tensor:
    """``[P]`` long: number of valid rewards per group."""
    if valid is None:
        return torch.full(
            rewards.shape[:1], rewards.shape[1], dtype=torch.long, device=rewards.device
        )
    return torch.count_nonzero(valid, dim=1)  # no [P, G] dtype conversion, unlike valid.sum


def group_mean(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[P]`` mean of the valid rewards of each group; 0 for a group with none.

    Invariant of the whole package: ``valid`` is exactly ``~isnan(rewards)`` (or None when
    nothing is NaN), so a NaN-skipping sum needs no mask.
    """
    if valid is None:
        return rewards.mean(dim=1)
    return rewards.nansum(dim=1) / group_count(valid, rewards).clamp_min(1).to(rewards.dtype)


class Moments(NamedTuple):
    """Per-group statistics of the valid rewards, computed once and reused by estimators."""

    count: torch.Tensor  # [P] long, valid rewards per group
    mean: torch.Tensor  # [P]
    std: torch.Tensor  # [P], with the requested ddof; 0 when count <= ddof
    dev: torch.Tensor  # [P, G] r - mean, exactly 0 at invalid entries; a fresh tensor
    collapsed: torch.Tensor  # [P] bool, std < tau or count < 2


def group_moments(
    rewards: torch.Tensor, valid: torch.Tensor | None, ddof: int = 1, tau: float = DEFAULT_TAU
) -> Moments:
    """Count, mean, std (``ddof``), centred rewards and collapse flag of every group.

    ``valid=None`` means every reward is valid (no masking). The centred tensor ``dev`` is
    the only ``[P, G]`` allocation: estimators transform it in place into their output, which
    keeps a 1M-sample batch at a few memory passes (fresh large tensors cost page faults).
    """
    count = group_count(valid, rewards)  # [P]
    mean = group_mean(rewards, valid)  # [P]
    dev = rewards - mean[:, None]  # [P, G]
    if valid is not None:
        dev = dev.nan_to_num_(0.0)  # NaN rewards (exactly the invalid ones) -> 0
    denom = (count - ddof).clamp_min(1).to(rewards.dtype)  # [P]
    # vector_norm: no [P, G] temporary (torch.std_mean over a short dim is ~100x slower on CPU)
    std = torch.linalg.vector_norm(dev, dim=1).div_(denom.sqrt_())  # [P]
    std = std.masked_fill_(count <= ddof, 0.0)
    return Moments(count, mean, std, dev, collapsed_mask(std, count, tau))


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise a ValueError naming the parameter when it is not a positive finite number."""
    ok = value is not None and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def collapsed_mask(std: torch.Tensor, count: torch.Tensor, tau: float) -> torch.Tensor:
    """``[P]`` bool: σ_q < tau or fewer than 2 valid rewards (ALGORITHMS.md §0).

    Never ``σ == 0``: float32 noise makes a constant group's std slightly non-zero.
    """
    return (std < tau) | (count < 2)


def zero_invalid(
    values: torch.Tensor, valid: torch.Tensor | None, collapsed: torch.Tensor
) -> torch.Tensor:
    """``values [P, G]`` with exact zeros at NaN rewards and in collapsed groups (in place)."""
    dead = collapsed[:, None] if valid is None else (~valid) | collapsed[:, None]  # [P, G]
    return values.masked_fill_(dead, 0.0)


def batch_std(values: torch.Tensor, valid: torch.Tensor | None, ddof: int = 1) -> torch.Tensor:
    """Scalar std of the valid entries of a ``[P, G]`` tensor (0 when there are <= ddof)."""
    if valid is None:
        if values.numel() <= ddof:
            return values.new_zeros(())
        return values.std(correction=ddof)
    n = valid.sum().to(values.dtype)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum() / n.clamp_min(1)
    dev = torch.where(valid, values - mean, torch.zeros_like(values))
    var = dev.square().sum() / (n - ddof).clamp_min(1)
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


def wrap_advantages(
    values: torch.Tensor,
    valid: torch.Tensor | None,
    collapsed: torch.Tensor,
    scale: torch.Tensor,
    kl_weight: torch.Tensor | None = None,
    *,
    zeroed: bool = False,
    **stats: float,
) -> Advantages:
    """An estimator's output as :class:`Advantages` (every group kept, ``updated`` = not
    collapsed); ``zeroed``: NaN entries and collapsed groups already hold 0."""
    p = values.shape[0]
    ones = torch.ones(p, dtype=values.dtype, device=values.device)
    return Advantages(
        values=values if zeroed else zero_invalid(values, valid, collapsed),
        keep=torch.ones(p, dtype=torch.bool, device=values.device),
        kl_weight=ones if kl_weight is None else kl_weight,
        scale=scale,
        stats={"collapsed_frac": float(collapsed.float().mean()), **stats},
        updated=~collapsed,
    )


def scale_dev(m: Moments, factor: torch.Tensor | float) -> torch.Tensor:
    """``[P, G]`` m.dev · factor_q, with collapsed groups zeroed in the same pass.

    ``m.dev`` is already 0 at NaN entries, so one multiply both scales and masks.
    """
    f = torch.as_tensor(factor, dtype=m.dev.dtype, device=m.dev.device).expand_as(m.mean)
    return m.dev.mul_(f.masked_fill(m.collapsed, 0.0)[:, None])
