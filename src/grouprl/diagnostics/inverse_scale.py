"""Inverse-scale tails: how much an estimator's denominator amplifies low-variance groups.

ALGORITHMS.md §5 [PAPER seed: MaxNorm-AC, Table 3]: P95 and P99 of 1/scale_q over the
*updated* groups. GRPO's reach 980/3100 on real runs (σ_q → 0 makes 1/σ_q unbounded);
RLOO / Dr.GRPO stay at 1; MaxNorm is bounded by 1/tau_res by construction.
"""

from __future__ import annotations

import torch

from grouprl.types import Advantages

__all__ = ["DEFAULT_QUANTILES", "inverse_scale_tail", "updated_groups"]

DEFAULT_QUANTILES = (0.5, 0.95, 0.99)
"""Quantiles reported by :func:`inverse_scale_tail` (P95/P99 from MaxNorm Table 3; P50 [OURS])."""


def updated_groups(adv: Advantages) -> torch.Tensor:
    """``[P]`` bool: groups that move the policy's reward branch.

    ``adv.updated`` when the estimator set it (kept and σ_q >= tau on the statistics it used,
    virtual samples included); otherwise [OURS] read off the result: kept and some A ≠ 0, which
    is right for every estimator and transform (a virtual-sample rescue counts as updated, a
    resolution skip does not).
    """
    if adv.updated is not None:
        return adv.updated.to(torch.bool) & adv.keep.to(torch.bool)
    nonzero = adv.values.abs().amax(dim=1) > 0  # [P]
    return adv.keep.to(torch.bool) & nonzero


def inverse_scale_tail(
    adv: Advantages,
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[len(quantiles)]`` quantiles of 1/scale_q over updated groups (NaN when there are none).

    ``mask`` (``[P]`` bool) further restricts the groups, e.g. to σ_q < 1e-2 as MaxNorm's
    Table 3 does. Computed with ``torch.nanquantile`` on a NaN-masked ``[P]`` vector, so there
    is no data-dependent shape and no host sync on a GPU.
    """
    sel = updated_groups(adv)  # [P]
    if mask is not None:
        sel = sel & mask.to(torch.bool)
    inv = 1.0 / adv.scale.to(torch.float64)  # [P]
    inv = torch.where(sel, inv, torch.full_like(inv, float("nan")))
    q = torch.tensor(quantiles, dtype=inv.dtype, device=inv.device)
    return torch.nanquantile(inv, q)  # [Q]
