"""TOPR: Tapered Off-Policy REINFORCE (ALGORITHMS.md §3).

Signature and ``stats`` as every surrogate (:mod:`grouprl.losses.surrogates`).
"""

from __future__ import annotations

import math

import torch

from grouprl.losses.ratio import (
    autograd_inputs,
    autograd_masked,
    check_inputs,
    linearized,
    masked_log_ratio,
    ratio_stats,
)
from grouprl.types import to_floats

__all__ = ["RATIO_LEVELS", "topr", "topr_autograd", "topr_weights"]

RATIO_LEVELS = ("seq_mean", "seq_sum")
"""How TOPR's sequence ratio is formed from the token log-ratios: ``seq_mean`` =
``exp(mean_t log ρ_t)``, length-normalised (verl pull request 6986, its docs/algo/topr.md:
"the length-normalized sequence-level importance ratio"); ``seq_sum`` = ``exp(Σ_t log ρ_t)``
= π(y|x)/μ(y|x), the trajectory ratio of the paper (Le Roux et al. 2025, arXiv 2503.14286,
§3, eq. for J_TOPR)."""

_LOG_RATIO_MAX = 20.0  # exp(20) ≈ 4.9e8: above any useful upper bound (verl's SAFETY_BOUND)


def topr_weights(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_low: float = 0.0,
    ratio_high: float = 1.0,
    ratio_level: str = "seq_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [N, 1], seq_ratio [N, 1])``: 1 for a sequence with mean advantage ≥ 0, else its
    sequence ratio clamped to ``[ratio_low, ratio_high]``.

    ``log_ratio [N, T]`` (0 at padding), ``adv [N, 1]`` or ``[N, T]`` (averaged over the valid
    tokens, as the PR's ``seq_adv``), ``mask [N, T]`` 0/1. A sequence without a valid token
    gets weight 1 (it adds nothing: its per-token loss is 0).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(
            f"topr: ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {ratio_level!r}"
        )
    lengths = mask.sum(-1, keepdim=True)  # [N, 1]
    log_seq = log_ratio.sum(-1, keepdim=True)  # [N, 1]
    if ratio_level == "seq_mean":
        log_seq = log_seq / lengths.clamp_min(1.0)
    seq_ratio = torch.exp(log_seq.clamp(max=_LOG_RATIO_MAX))  # [N, 1]
    if adv.shape[-1] == 1:
        seq_adv = adv
    else:
        seq_adv = (adv * mask).sum(-1, keepdim=True) / lengths.clamp_min(1.0)
    tapered = seq_ratio.clamp(ratio_low, ratio_high)
    weight = torch.where(seq_adv >= 0, torch.ones_like(seq_ratio), tapered)
    return weight, seq_ratio


def _check_bounds(ratio_low: float, ratio_high: float) -> None:
    if not (math.isfinite(ratio_low) and math.isfinite(ratio_high) and ratio_low >= 0):
        raise ValueError(
            f"topr: ratio_low / ratio_high must be finite with ratio_low >= 0, got "
            f"{ratio_low} / {ratio_high}"
        )
    if ratio_high < ratio_low:
        raise ValueError(f"topr: ratio_high {ratio_high} is below ratio_low {ratio_low}")


def topr(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_low: float = 0.0,
    ratio_high: float = 1.0,
    ratio_level: str = "seq_mean",
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TOPR: ``ℓ_t = −A·w_i·logp_t``, ``w_i = 1`` if A_i ≥ 0 else ``sg(clip(ρ_i, 0, 1))``.

    Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286, §3): positive
    sequences are reinforced as in SFT (no importance weight), negative ones are weighted by
    their sequence ratio ρ_i = π/μ truncated to [0, 1], so an off-policy negative sample keeps
    a bounded, non-zero gradient where PPO's clip would give 0. The weight is a constant
    (stop-gradient). verl pull request 6986 (``compute_policy_loss_topr``, policy loss
    ``topr``): ρ_i the length-normalised ratio (``ratio_level="seq_mean"``, our default),
    bounds ``policy_loss.topr_negative_ratio_lower`` / ``_upper`` = ``ratio_low`` /
    ``ratio_high`` (default 0 / 1), sign test ``mean_t A ≥ 0``, loss value ``−A·w·logp``, and
    the per-sequence token mean pinned (``seq_mean_token_mean`` here: pass it as the
    aggregation). The paper's ρ is the trajectory ratio Π_t ρ_t: ``ratio_level="seq_sum"``.
    On-policy (ρ ≡ 1) TOPR is REINFORCE.

    Stats: the ratio stats of :func:`~grouprl.losses.ratio.ratio_stats` (token ρ), and
    ``taper_weight_mean`` (mean w over sequences with a valid token; verl's
    ``actor/topr_taper_weight_mean``), ``negative_frac`` (sequences with A < 0).
    """
    _check_bounds(ratio_low, ratio_high)
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():
        log_ratio = masked_log_ratio(lp, old, mask)  # [N, T], 0 at padding
        weight, _ = topr_weights(
            log_ratio,
            adv,
            mask,
            ratio_low=ratio_low,
            ratio_high=ratio_high,
            ratio_level=ratio_level,
        )  # [N, 1]
        slope = -adv * weight  # [N, 1] or [N, T]
        value = (slope * lp) * mask  # −A·w·logp, 0 at padding
        values = None
        if stats:
            values = ratio_stats(None, adv, mask, None, None, log_ratio, padding=1.0)
            rows = mask.sum(-1) > 0  # [N]
            n_rows = rows.sum().clamp_min(1)
            neg = (adv * mask).sum(-1) < 0
            values["taper_weight_mean"] = weight[:, 0][rows].sum() / n_rows
            values["negative_frac"] = (neg & rows).sum() / n_rows
    if slope.shape[-1] == 1:
        per_token = linearized(logp, value, slope, mask)
    else:
        per_token = linearized(logp, value, slope * mask)
    return per_token, ({} if values is None else to_floats(values))


def topr_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_low: float = 0.0,
    ratio_high: float = 1.0,
    ratio_level: str = "seq_mean",
) -> torch.Tensor:
    """:func:`topr` in plain autograd: ``−A·sg(w_i)·logp`` with :func:`topr_weights`."""
    _check_bounds(ratio_low, ratio_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    weight, _ = topr_weights(
        (lp - old).detach() * m,
        a,
        m,
        ratio_low=ratio_low,
        ratio_high=ratio_high,
        ratio_level=ratio_level,
    )
    return autograd_masked(-a * weight.detach() * lp, m)
