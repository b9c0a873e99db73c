"""Masked per-group statistics shared by every estimator. All functions are pure and batched.

A reward tensor is ``[P, G]`` with NaN for missing entries; ``valid`` is its ``[P, G]`` mask.
"""

from __future__ import annotations

import math

import torch

DEFAULT_TAU = 1e-6
"""Collapse threshold on σ_q (ALGORITHMS.md §0, ACR paper): never test σ == 0."""


def validate_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Check a reward batch and return its ``[P, G]`` validity mask (True = not NaN).

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
    if torch.isinf(rewards).any():
        n = int(torch.isinf(rewards).sum())
        raise ValueError(
            f"rewards contains {n} infinite value(s); a verifier should return a finite "
            "score, or NaN when it cannot score (NaN is excluded and counted)"
        )
    return ~torch.isnan(rewards)


def group_count(valid: torch.Tensor) -> torch.Tensor:
    """``[P]`` number of valid rewards per group (float)."""
    return valid.sum(dim=1, dtype=torch.float32).to(torch.get_default_dtype())


def group_mean(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[P]`` mean of the valid rewards of each group; 0 for a group with none."""
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))  # [P, G]
    n = valid.sum(dim=1).to(rewards.dtype)  # [P]
    return filled.sum(dim=1) / n.clamp_min(1)


def group_std(
    rewards: torch.Tensor, valid: torch.Tensor, mean: torch.Tensor | None = None, ddof: int = 1
) -> torch.Tensor:
    """``[P]`` std of the valid rewards of each group, with ``ddof`` (1 = Bessel, TRL/verl).

    A group with ``n <= ddof`` valid rewards gets std 0 (it is collapsed by definition).
    """
    if mean is None:
        mean = group_mean(rewards, valid)
    dev = torch.where(valid, rewards - mean[:, None], torch.zeros_like(rewards))  # [P, G]
    n = valid.sum(dim=1).to(rewards.dtype)  # [P]
    var = dev.square().sum(dim=1) / (n - ddof).clamp_min(1)
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))


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
    values: torch.Tensor, valid: torch.Tensor, collapsed: torch.Tensor
) -> torch.Tensor:
    """``[P, G]``: exact zeros at NaN rewards and in collapsed groups."""
    live = valid & ~collapsed[:, None]  # [P, G]
    return torch.where(live, values, torch.zeros_like(values))


def batch_std(values: torch.Tensor, valid: torch.Tensor, ddof: int = 1) -> torch.Tensor:
    """Scalar std of the valid entries of a ``[P, G]`` tensor (0 when there are <= ddof)."""
    n = valid.sum().to(values.dtype)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum() / n.clamp_min(1)
    dev = torch.where(valid, values - mean, torch.zeros_like(values))
    var = dev.square().sum() / (n - ddof).clamp_min(1)
    return torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))
