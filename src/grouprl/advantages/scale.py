"""Bounded-scale estimators: maxnorm_rloo, maxnorm_dr_grpo (MaxNorm-AC) and p90
(ALGORITHMS.md §1).

Each divides a trusted raw numerator ``u`` by one per-group scale card ``s_q``, so sign,
order and ratios of the advantages within a group are preserved. ``c = u / s_q`` is a plain
tensor computed from rewards: it is a constant in the loss by construction (the paper's
stop-gradient ``sg(c)``), and the KL term is not divided by ``s_q`` (``kl_weight = 1``).
"""

from __future__ import annotations

import numpy as np
import torch

from grouprl.advantages._groups import (
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    column_mean,
    column_range,
    dev_collapsed,
    group_mean,
    group_moments,
    host,
    scale_dev,
    shared_statistics,
    sorted_rows,
    top_two,
    transposed,
    transposed_times,
    wrap_advantages,
    zero_where,
)
from grouprl.advantages.baseline import DEFAULT_DDOF, rloo_factor
from grouprl.types import Advantages

DEFAULT_TAU_RES = 1e-2
"""Lower bound of the MaxNorm scale card, equal to the default resolution ``delta_res``
(MaxNorm paper: s_q = max(tau_res, ...), rewards in [0, 1]); 1/tau_res bounds the inverse scale."""


def _numerator(
    kind: str, rewards, valid, ddof, tau
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, u [P, G], factor [P])``: the raw numerator u = factor·(r − r̄), 0 at NaN entries."""
    m = group_moments(rewards, valid, ddof, tau)
    factor = rloo_factor(m.count, rewards.dtype) if kind == "rloo" else torch.ones_like(m.mean)
    return m, m.dev, factor


def _maxnorm(kind, rewards, valid, tau_res, ddof, tau):
    if valid is None and 2 <= rewards.shape[1] <= SORT_NETWORK_MAX and rewards.shape[1] > ddof:
        return _maxnorm_columns(kind, rewards, tau_res, ddof, tau)
    m, dev, factor = _numerator(kind, rewards, valid, ddof, tau)
    if dev.shape[1] <= SORT_NETWORK_MAX:  # on the columns: ~3x faster than aminmax(dim=1)
        lo, hi = column_range(transposed(dev).unbind(0))  # [P] each
    else:
        lo, hi = torch.aminmax(dev, dim=1)  # [P] each: max|u| without a [P, G] temporary
    card = torch.maximum(hi, -lo) * factor  # [P] max_j |u_j|
    return _divide_by_card(m, valid, factor, card, tau_res)


def _maxnorm_columns(kind, rewards, tau_res, ddof, tau) -> Advantages:
    """:func:`_maxnorm` without NaN, on the G columns ``[P]``: the same floats.

    [OURS] Every step after the group mean is elementwise per group (u = factor·(r − r̄), the
    card, A = u·(factor/s_q)), so it runs on the transposed ``[G, P]`` batch, where a
    per-group ``[P]`` operand is a contiguous row (a ``[P, 1]`` operand broadcast over a
    short last dimension costs ~3x as much on CPU). The mean is the rows' own
    ``rewards.mean(1)`` floats (a sum's rounding depends on its order), summed on the columns
    where :func:`~grouprl.advantages._groups.column_mean` knows torch's order, and the collapse flag comes
    from the range of the centred rewards (:func:`~grouprl.advantages._groups.dev_collapsed`)
    instead of σ_q, which nothing else here reads. Every group has G samples, so the RLOO
    factor G/(G − 1) is one number.
    """
    g = rewards.shape[1]
    shared = shared_statistics(rewards, None, ddof, tau)  # the trigger's moments, if any
    cols = transposed(rewards)  # [G, P]
    mean = shared.mean if shared is not None else None  # [P]
    if mean is None and rewards.is_contiguous():
        mean = column_mean(cols)  # the rows' mean floats, from the columns
    if mean is None:
        mean = group_mean(rewards, None)
    if not bool(torch.isfinite(mean.sum())):  # an overflowing group sum: the general path
        m, dev, factor = _numerator(kind, rewards, None, ddof, tau)
        lo, hi = column_range(transposed(dev).unbind(0))
        return _divide_by_card(m, None, factor, torch.maximum(hi, -lo) * factor, tau_res)
    dev = cols.sub_(mean)  # [G, P] rewards − mean, the rows' floats
    lo, hi = torch.amin(dev, 0), torch.amax(dev, 0)  # [P] each (exact, any order)
    one = torch.full((1,), g, dtype=torch.long, device=rewards.device)
    factor = rloo_factor(one, rewards.dtype) if kind == "rloo" else torch.ones_like(mean[:1])
    card = torch.maximum(hi, lo.neg()).mul_(factor)  # [P] max_j |u_j|
    if shared is None:
        collapsed = dev_collapsed(rewards, lo, hi, ddof, tau)  # [P]
    else:
        collapsed = shared.collapsed
    s = card.clamp_min(tau_res)  # [P]
    values = transposed_times(dev, zero_where(torch.div(factor, s), collapsed))  # [P, G]
    bound = _floor_frac(card, tau_res, collapsed)
    return wrap_advantages(values, None, collapsed, s, zeroed=True, tau_res_bound_frac=bound)


def _floor_frac(card: torch.Tensor, tau_res: float, collapsed: torch.Tensor) -> float:
    """:func:`_frac` ``(card.clamp_min(tau_res) <= tau_res, collapsed)``, the same float, for a
    card that is never NaN: the share of live groups whose card is at most tau_res.

    [OURS] Counted on :func:`~grouprl.advantages._groups.host` arrays (numpy's comparisons
    and counts, where torch's CPU comparisons into bool take several passes), then divided
    as :func:`_frac` divides (two int64 tensors)."""
    card_, collapsed_ = host(card), host(collapsed)
    if not isinstance(card_, np.ndarray):
        return _frac(card.clamp_min(tau_res) <= tau_res, collapsed)
    live = ~collapsed_
    n_live = np.count_nonzero(live)
    n_floor = np.count_nonzero((card_ <= tau_res) & live)
    on = card.device
    return float(torch.tensor(n_floor, device=on) / torch.tensor(n_live, device=on).clamp_min(1))


def _row_quantile(
    x: torch.Tensor, valid: torch.Tensor | None, count: torch.Tensor, q: float
) -> torch.Tensor:
    """``[P]`` q-quantile of each row's valid entries, linear interpolation (numpy's default).

    Sort-based (:func:`sorted_rows`: a sorting network over the G columns): ``torch.nanquantile``
    is ~10x slower on many short rows, ``torch.sort`` ~10x slower than the network. Without
    NaN, when the two order statistics are the two largest (q·(G − 1) >= G − 2), one
    :func:`~grouprl.advantages._groups.top_two` scan instead of the network. 0 for an empty row.
    """
    g = x.shape[1]
    if valid is None:  # every row has G entries: the same two order statistics for all
        pos = q * torch.tensor(g - 1, dtype=x.dtype)  # [] in x's precision, as below
        lo = int(pos.floor())
        if 2 <= g <= SORT_NETWORK_MAX and lo >= g - 2:  # the two largest suffice (P90, G <= 11)
            a, b = top_two(transposed(x).unbind(0))  # [P] each: 2nd largest, largest
            if lo == g - 1:
                a = b
        else:
            ordered = sorted_rows(x)  # [G, P]
            a, b = ordered[lo], ordered[min(lo + 1, g - 1)]  # [P] each
        return a + (pos - lo) * (b - a)
    ordered = sorted_rows(x.masked_fill(~valid, float("inf")))  # [G, P], invalid entries last
    pos = q * (count - 1).clamp_min(0).to(x.dtype)  # [P]
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (count - 1).clamp_min(0))
    a = ordered.gather(0, lo[None]).squeeze(0)
    b = ordered.gather(0, hi[None]).squeeze(0)
    out = a + (pos - lo.to(x.dtype)) * (b - a)
    return out.masked_fill(count == 0, 0.0)


def _divide_by_card(m, valid, factor, card, tau_res) -> Advantages:
    """A = u / s_q with the scale card s_q = max(tau_res, card); u = factor·(r − r̄)."""
    s = card.clamp_min(tau_res)  # [P]
    values = scale_dev(m, factor / s)  # [P, G]
    bound = _frac(s <= tau_res, m.collapsed)
    return wrap_advantages(values, valid, m.collapsed, s, zeroed=True, tau_res_bound_frac=bound)


def _frac(mask: torch.Tensor, collapsed: torch.Tensor) -> float:
    live = ~collapsed
    return float((mask & live).sum() / live.sum().clamp_min(1))


def maxnorm_rloo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
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
    valid: torch.Tensor | None,
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
    valid: torch.Tensor | None,
    *,
    quantile: float = 0.9,
    tau_res: float = DEFAULT_TAU_RES,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """P90: u = RLOO numerator, s_q = max(tau_res, P90_j |u_j|), A = u / s_q (|A| may exceed 1).

    [DIGEST]+[OURS] the MaxNorm paper's "percentile-scale robust reference": the quantile is
    taken over the group's valid |u_j| with linear interpolation (as ``numpy.quantile``).
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    m, dev, factor = _numerator("rloo", rewards, valid, ddof, tau)  # dev [P, G], factor [P]
    card = _row_quantile(dev.abs(), valid, m.count, quantile) * factor  # [P] P90_j |u_j|
    return _divide_by_card(m, valid, factor, card, tau_res)
