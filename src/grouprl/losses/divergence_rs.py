"""Divergence-gated rejection of rollouts: the sampled token's binary KL (or TV) between the
rollout engine and the trainer (ALGORITHMS.md §3c).

A rollout-correction method of :mod:`grouprl.losses.correction` (registered there as
``binary_kl``). Unlike the ratio-based methods it reads the two log-probabilities themselves,
not only their difference: the binary KL of a token depends on how likely it was.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from grouprl.losses.ratio import LOG_RATIO_CLAMP

__all__ = [
    "DIVERGENCES",
    "DROPS",
    "PROB_CLAMP",
    "RejectionParts",
    "binary_kl_rejection",
    "token_divergence",
]


class RejectionParts(NamedTuple):
    """What :func:`binary_kl_rejection` returns: the fields of ``correction.Parts``
    (``weight [N, T]``, ``keep [N, T]`` bool, ``stats``), defined here because
    :mod:`grouprl.losses.correction` imports this module for its registry."""

    weight: torch.Tensor
    keep: torch.Tensor
    stats: dict[str, torch.Tensor]


PROB_CLAMP = 1e-6
"""Probabilities are clamped to ``[1e-6, 1 − 1e-6]`` before the logs (OpenRLHF 0.11.2
``models/loss.py`` ``PolicyLoss.forward``; the same constant in miles'
``binary_kl_trust_region_function``), so a token of probability 1 or 0 stays finite."""

DIVERGENCES = ("binary_kl", "tv")
DROPS = ("reject", "zero")


def token_divergence(
    rollout_logp: torch.Tensor, train_logp: torch.Tensor, divergence: str = "binary_kl"
) -> torch.Tensor:
    """``[N, T]`` per-token divergence of the sampled token's Bernoulli distributions.

    With ``p = μ(y_t)`` (rollout) and ``q = π(y_t)`` (trainer), clamped by
    :data:`PROB_CLAMP`: ``binary_kl`` = KL(Bern(p) ‖ Bern(q)) = ``p·log(p/q) + (1 − p)·
    log((1 − p)/(1 − q))`` (the sampled token against the rest of the vocabulary; DPPO's
    binary approximation, FlashREINFORCE's trust region); ``tv`` = ``|p − q|``.
    """
    p = rollout_logp.exp().clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    q = train_logp.exp().clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    if divergence == "tv":
        return (p - q).abs()
    return p * (p / q).log() + (1.0 - p) * ((1.0 - p) / (1.0 - q)).log()


def binary_kl_rejection(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    threshold: float | None = None,
    level: str = "seq_mean",
    divergence: str = "binary_kl",
    drop: str = "reject",
    is_weight: bool = False,
) -> RejectionParts:
    """Reject tokens / sequences whose binary KL (or TV) to the rollout exceeds ``threshold``.

    The statistic is :func:`token_divergence` per token (``level="token"``) or its mean over
    the sequence's valid tokens (``level="seq_mean"``, FlashREINFORCE's sequence trust
    region); units above ``threshold`` (δ, an upper bound only) are dropped. ``drop``:
    ``"reject"`` (``keep = False``: out of every branch and normaliser, as verl's
    ``rollout_rs`` rewrites ``response_mask``; the mode of verl pull request 6800, whose head
    we could not read) or ``"zero"`` (weight 0, kept in the normaliser: OpenRLHF
    ``is_correction_mode=mask``). ``is_weight=True`` multiplies the kept tokens by their ratio
    ρ_t = π/μ (OpenRLHF's mask mode: "survivors keep their per-token IS weight"; clamped at
    ±20 in log as every method here). OpenRLHF 0.11.2 ``--algo.advantage.is_correction_gating
    binary_kl`` with ``is_correction_level`` token / seq and a single threshold is
    ``drop="zero", is_weight=True`` (parity-tested against its ``PolicyLoss``). A NaN
    statistic compares False and is dropped.

    Stats: ``rejected_frac`` (valid tokens dropped), ``rejected_seq_frac`` (sequences that
    lost a token), ``divergence_mean`` (token mean of the statistic).
    """
    if not isinstance(threshold, int | float) or not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(
            f"binary_kl: needs threshold >= 0, the largest {divergence} kept (an upper bound "
            f"only, e.g. 1e-3), got threshold={threshold}"
        )
    if level not in ("token", "seq_mean"):
        raise ValueError(f"binary_kl: level must be token or seq_mean, got {level!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"binary_kl: divergence must be one of {', '.join(DIVERGENCES)}")
    if drop not in DROPS:
        raise ValueError(f"binary_kl: drop must be one of {', '.join(DROPS)}, got {drop!r}")
    m = mask.to(log_ratio.dtype)
    stat = torch.where(mask, token_divergence(rollout_logp, train_logp, divergence), 0.0)
    div_mean = stat.sum() / m.sum().clamp_min(1.0)
    if level == "seq_mean":
        stat = (stat.sum(-1) / m.sum(-1).clamp_min(1.0))[:, None]  # [N, 1]
    ok = (stat <= threshold).expand_as(mask) & mask  # NaN: False
    dropped = mask & ~ok
    weight = m
    if is_weight:
        weight = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * m
    if drop == "zero":
        weight, keep = weight * ok.to(weight.dtype), mask.clone()
    else:
        keep = ok
    rows = mask.any(-1)
    n_tok, n_rows = m.sum().clamp_min(1.0), rows.to(m.dtype).sum().clamp_min(1.0)
    stats = {
        "rejected_frac": dropped.to(m.dtype).sum() / n_tok,
        "rejected_seq_frac": dropped.any(-1).to(m.dtype).sum() / n_rows,
        "divergence_mean": div_mean,
    }
    return RejectionParts(weight, keep, stats)
