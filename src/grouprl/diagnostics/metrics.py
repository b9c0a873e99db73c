"""Per-step training-health metrics for the trainer: one cheap call, flat namespaced floats."""

from __future__ import annotations

import torch

from grouprl.advantages._groups import batch_std
from grouprl.diagnostics.acr import DEFAULT_TAU, collapse_split
from grouprl.diagnostics.inverse_scale import inverse_scale_tail, updated_groups
from grouprl.diagnostics.regime import sigma_mean_cv
from grouprl.types import Advantages, to_floats

__all__ = ["STEP_METRIC_KEYS", "step_metrics"]

STEP_METRIC_KEYS: tuple[str, ...] = (
    "acr/rate",
    "acr/all_correct",
    "acr/all_wrong",
    "acr/other",
    "acr/insufficient",
    "acr/groups",
    "reward/mean",
    "reward/std",
    "reward/nan_count",
    "reward/nan_frac",
    "adv/abs_mean",
    "adv/abs_max",
    "adv/keep_frac",
    "adv/updated_frac",
    "adv/kl_weight_mean",
    "adv/kl_weight_max",
    "scale/inv_p50",
    "scale/inv_p95",
    "scale/inv_p99",
    "scale/inv_max",
    "regime/sigma_mean",
    "regime/sigma_cv",
    "regime/mixed_hi_frac",
)
"""Every key :func:`step_metrics` returns, in order (docs/diagnostics.md is the glossary)."""


def step_metrics(
    rewards: torch.Tensor,
    adv: Advantages,
    *,
    reward_range: tuple[float, float] = (0.0, 1.0),
    tau: float = DEFAULT_TAU,
) -> dict[str, float]:
    """Health metrics of one step's reward batch ``[P, G]`` and its advantages, as floats.

    Keys (:data:`STEP_METRIC_KEYS`):

    - ``acr/*``: collapse rate and its split into all-correct / all-wrong / other, as
      fractions of the P groups, plus ``acr/insufficient`` (< 2 valid rewards) and
      ``acr/groups`` = P (ALGORITHMS.md §5, [PAPER] ACR paper).
    - ``reward/*``: mean and std (ddof 0) of the valid rewards; NaN (unscorable) count and
      fraction — NaN rewards are counted, never scored 0.
    - ``adv/*``: |A| mean and max over valid samples of kept groups; the fraction of kept
      groups; of *updated* groups (kept and some A ≠ 0); mean / max ``kl_weight``.
    - ``scale/inv_*``: P50 / P95 / P99 / max of 1/scale_q over updated groups
      ([PAPER seed] MaxNorm Table 3). 0.0 when no group was updated [OURS: keeps the JSONL
      free of NaN; ``adv/updated_frac`` = 0 says why].
    - ``regime/sigma_mean``, ``regime/sigma_cv``: mean σ_q over non-collapsed groups and its
      coefficient of variation across them (["Why GRPO needs normalization"] + [OURS]).
    - ``regime/mixed_hi_frac``: of the mixed (non-collapsed) groups, the fraction whose mean
      valid reward, rescaled to [0, 1] by ``reward_range``, is ≥ 0.5: the groups where
      F-GRPO's focal weight (1 − μ̂)^γ scales the update by 2^-γ or less (F-GRPO §4, with
      μ̂ the group's success rate). [OURS] the F-GRPO audit: the focal weight only matters
      when this share is large (reproductions/maze required ≥ 0.5); 0.0 with no mixed group.

    Cost: a handful of batched reductions over ``[P, G]`` and one host transfer at the end
    (no Python loop over groups, one ``.tolist()``), far below 1 % of a training step.
    """
    split = collapse_split(rewards, tau=tau, reward_range=reward_range)
    valid = ~torch.isnan(rewards)  # [P, G]
    p, g = rewards.shape
    f = torch.float64
    frac = {k: split[k].to(f).mean() for k in ("collapsed", "all_correct", "all_wrong", "other")}
    vals = torch.where(valid, rewards, torch.zeros_like(rewards)).to(f)  # [P, G]
    r_mean = vals.sum() / valid.sum().clamp_min(1)
    r_std = batch_std(vals, valid, ddof=0)
    nan_count = (~valid).sum().to(f)

    keep = adv.keep.to(torch.bool)  # [P]
    a_abs = adv.values.to(f).abs()  # [P, G]
    a_mask = valid & keep[:, None]  # [P, G]
    a_abs_m = torch.where(a_mask, a_abs, torch.zeros_like(a_abs))
    upd = updated_groups(adv)  # [P]
    kl_w = adv.kl_weight.to(f)

    tail = torch.nan_to_num(inverse_scale_tail(adv, (0.5, 0.95, 0.99, 1.0)), nan=0.0).to(f)  # [4]

    s_mean, s_cv = sigma_mean_cv(split["sigma"], ~split["collapsed"])
    mixed = ~split["collapsed"]  # [P]; a mixed group has >= 2 valid rewards
    lo, hi = float(reward_range[0]), float(reward_range[1])
    mu = (vals.sum(1) / valid.sum(1).clamp_min(1) - lo) / (hi - lo)  # [P] success rate
    mixed_hi = (mixed & (mu >= 0.5)).sum().to(f) / mixed.sum().clamp_min(1).to(f)

    step = {  # 0-dim tensors; one host transfer below
        "acr/rate": frac["collapsed"],
        "acr/all_correct": frac["all_correct"],
        "acr/all_wrong": frac["all_wrong"],
        "acr/other": frac["other"],
        "acr/insufficient": split["insufficient"].to(f).mean(),
        "acr/groups": torch.tensor(float(p), dtype=f, device=rewards.device),
        "reward/mean": r_mean,
        "reward/std": r_std,
        "reward/nan_count": nan_count,
        "reward/nan_frac": nan_count / float(p * g),
        "adv/abs_mean": a_abs_m.sum() / a_mask.sum().clamp_min(1),
        "adv/abs_max": a_abs_m.amax(),
        "adv/keep_frac": keep.to(f).mean(),
        "adv/updated_frac": upd.to(f).mean(),
        "adv/kl_weight_mean": kl_w.mean(),
        "adv/kl_weight_max": kl_w.amax(),
        "scale/inv_p50": tail[0],
        "scale/inv_p95": tail[1],
        "scale/inv_p99": tail[2],
        "scale/inv_max": tail[3],
        "regime/sigma_mean": s_mean,
        "regime/sigma_cv": s_cv,
        "regime/mixed_hi_frac": mixed_hi,
    }
    return to_floats(step)
