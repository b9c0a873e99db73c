"""Per-sample inputs for the estimators that read them (advantages.needs), derived from the
rewards so that the properties of the layer still hold: lengths depend on r − min(row) (shift
invariant, permuted with the rewards), the greedy baseline is the row's lower median (shift
and permutation invariant, equal to the rewards of a constant group)."""

from __future__ import annotations

import torch

from grouprl import advantages


def lengths_for(rewards: torch.Tensor) -> torch.Tensor:
    """``[P, G]`` token counts in 1..13, a function of r − nanmin(row)."""
    lo = torch.where(torch.isnan(rewards), torch.full_like(rewards, float("inf")), rewards)
    d = (rewards - lo.amin(1, keepdim=True)).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return 1 + (torch.round(d * 1000).long() % 13)


def baseline_for(rewards: torch.Tensor) -> torch.Tensor:
    """``[P]`` the lower median of each row's valid rewards (NaN for an empty row)."""
    return torch.nanmedian(rewards, dim=1).values


def inputs_for(name: str, rewards: torch.Tensor, **params) -> dict:
    reads = advantages.needs(name, **params)
    out = {}
    if "lengths" in reads:
        out["lengths"] = lengths_for(rewards)
    if "baseline" in reads:
        out["baseline"] = baseline_for(rewards)
    return out


def compute(name: str, rewards: torch.Tensor, **kw) -> advantages.Advantages:
    """``advantages.compute`` with the inputs the estimator reads."""
    return advantages.compute(name, rewards, **inputs_for(name, rewards, **kw), **kw)


def reference_inputs(name: str, rewards: torch.Tensor) -> dict:
    """The same inputs as NumPy arrays, for ``reference.per_group``."""
    return {k: v.numpy() for k, v in inputs_for(name, rewards).items()}
