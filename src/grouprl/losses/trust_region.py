"""Surrogates whose trust region is a divergence, not PPO's ratio band (ALGORITHMS.md §3).

- :func:`dppo_tv`, :func:`dppo_kl`: DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM
  Reinforcement Learning", arXiv 2602.04879): drop a token's gradient once the sampled token's
  probability has moved too far, measured by the binary TV or binary KL divergence.
- :func:`dro`: a quadratic log-ratio penalty in place of a clip (verl ``dro``).

Signature and ``stats`` as every surrogate (:mod:`grouprl.losses.surrogates`).
"""

from __future__ import annotations

import math

import torch

from grouprl.losses.ratio import (
    LOG_RATIO_CLAMP,
    autograd_inputs,
    autograd_masked,
    beyond_count,
    check_inputs,
    linearized,
    masked_log_ratio,
    ratio_stats,
    valid_sum,
)
from grouprl.types import to_floats

__all__ = [
    "binary_kl",
    "dppo_kl",
    "dppo_kl_autograd",
    "dppo_tv",
    "dppo_tv_autograd",
    "dro",
    "dro_autograd",
]

DPPO_TRUNCATION = 20.0
"""DPPO's truncation C of the stop-gradient IS weight: verl's fallback for ``clip_ratio_c`` in
``compute_policy_loss_dppo_*`` ("a large threshold is recommended", DPPO §5.4). verl's
``ActorConfig.clip_ratio_c`` default (3.0, the dual clip's) wins when the config holds it."""
BINARY_KL_EPS = 1e-8
"""Added inside the log of the binary KL's second term (verl ``compute_policy_loss_dppo_kl``)."""


def binary_kl(
    old_logp: torch.Tensor, logp: torch.Tensor, eps: float = BINARY_KL_EPS
) -> torch.Tensor:
    """KL(Bern(p_old) ‖ Bern(p)) of the sampled token's probability, from log-probabilities.

    ``p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + eps)/(1 − p + eps))`` (DPPO's
    binary approximation; verl ``core_algos.py:1513-1515``).
    """
    p_old, p = torch.exp(old_logp), torch.exp(logp)
    return p_old * (old_logp - logp) + (1.0 - p_old) * torch.log(
        (1.0 - p_old + eps) / (1.0 - p + eps)
    )


def _dppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: str,
    delta_low: float,
    delta_high: float,
    clip_ratio_c: float,
    log_ratio_clamp: float,
    binary_kl_eps: float,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The shared body of DPPO-TV and DPPO-KL: ``ℓ = −A·sg(min(ρ, C))·log π·valid``."""
    for name, value in (("delta_low", delta_low), ("delta_high", delta_high)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"DPPO's {name} (a divergence threshold) must be >= 0, got {value}")
    if not clip_ratio_c > 0:
        raise ValueError(f"clip_ratio_c (the IS-weight truncation) must be > 0, got {clip_ratio_c}")
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():  # the weight and the region carry no gradient: only logp does
        log_ratio = masked_log_ratio(lp, old, mask).clamp_(-log_ratio_clamp, log_ratio_clamp)
        ratio = torch.exp(log_ratio)  # [N, T], 1 at padding
        # probabilities of the sampled token; at padding whatever they are, masked below
        p, p_old = torch.exp(lp), torch.exp(old)
        if divergence == "tv":
            ok_pos = (p - p_old) <= delta_high
            ok_neg = (p - p_old) >= -delta_low
        else:
            kl = binary_kl(old, lp, binary_kl_eps)
            ok_pos = (kl <= delta_high) | (p <= p_old)
            ok_neg = (kl <= delta_low) | (p >= p_old)
        pos = adv > 0
        valid = ((ok_pos & pos) | (ok_neg & ~pos)).to(mask.dtype)  # [N, T] 0/1
        slope = (-adv * ratio.clamp(max=clip_ratio_c)).mul_(valid).mul_(mask)  # −A·sg(min(ρ, C))
        value = slope * lp  # the loss −A·sg(min(ρ, C))·valid·logp, 0 at padding
        values = None
        if stats:
            n = mask.sum()
            values = ratio_stats(
                ratio, adv, mask, None, None, log_ratio, padding=1.0, scratch=log_ratio
            )
            values["clip_frac_region"] = (n - valid_sum(valid, mask)) / n
            truncated = beyond_count(ratio, clip_ratio_c, valid, below=False, scratch=p, mask=mask)
            values["clip_frac_truncated"] = truncated / n
    per_token = linearized(logp, value, slope)
    return per_token, ({} if values is None else to_floats(values))


def dppo_tv(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    clip_ratio_c: float = DPPO_TRUNCATION,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV: a token keeps its gradient while ``π − π_old`` stays within the band.

    ``ℓ = −A·sg(min(ρ, C))·log π·valid``, ``valid`` = ``π − π_old ≤ δ_high`` where A > 0 and
    ``π − π_old ≥ −δ_low`` where A ≤ 0, on the sampled token's probabilities (DPPO, arXiv
    2602.04879; verl ``compute_policy_loss_dppo_tv``, core_algos.py:1379-1457). The weight is
    truncated at C (:data:`DPPO_TRUNCATION`) and carries no gradient. verl reads δ from
    ``clip_ratio_low/high`` (default 0.2, the value here [OURS: the paper's per-model
    thresholds were not in the text available]). Stats: ``clip_frac_region`` (tokens outside
    the trust region, verl's ``pg_clipfrac``), ``clip_frac_truncated`` (ρ > C inside it, verl's
    ``pg_clipfrac_lower``).
    """
    return _dppo(
        logp,
        old_logp,
        adv,
        mask,
        divergence="tv",
        delta_low=delta_low,
        delta_high=delta_high,
        clip_ratio_c=clip_ratio_c,
        log_ratio_clamp=log_ratio_clamp,
        binary_kl_eps=BINARY_KL_EPS,
        stats=stats,
    )


def dppo_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    clip_ratio_c: float = DPPO_TRUNCATION,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    binary_kl_eps: float = BINARY_KL_EPS,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL: DPPO-TV's loss, the trust region measured by the binary KL instead.

    As :func:`dppo_tv`, with :func:`binary_kl` as the divergence.

    ``valid`` = ``KL ≤ δ_high or π ≤ π_old`` where A > 0, ``KL ≤ δ_low or π ≥ π_old`` where
    A ≤ 0: a token moving in the direction that *shrinks* its update is never masked (verl
    ``compute_policy_loss_dppo_kl``, core_algos.py:1460-1542).
    """
    return _dppo(
        logp,
        old_logp,
        adv,
        mask,
        divergence="kl",
        delta_low=delta_low,
        delta_high=delta_high,
        clip_ratio_c=clip_ratio_c,
        log_ratio_clamp=log_ratio_clamp,
        binary_kl_eps=binary_kl_eps,
        stats=stats,
    )


def dro(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float | None = None,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO: ``ℓ = −(A·log π − ½β·(log π − log π_old)²)``: REINFORCE with a quadratic
    log-ratio penalty instead of a clip.

    verl ``compute_policy_loss_dro`` (core_algos.py:2014-2044, "Direct Reward Optimization with
    a quadratic log-ratio penalty"), ``policy_loss.dro_beta``. β has no default in verl and must
    be given (> 0). On-policy the penalty's gradient is 0; it pulls back only once the policy
    has moved (minibatches × epochs > 1). No ratio clamp (verl has none).
    """
    if beta is None or not (math.isfinite(beta) and beta > 0):
        raise ValueError(
            f"DRO needs beta > 0 (the quadratic penalty weight; verl policy_loss.dro_beta has "
            f"no default), got {beta}"
        )
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():
        log_ratio = masked_log_ratio(lp, old, mask)  # [N, T], 0 at padding
        # −(A·logp − ½β·(log ρ)²), written as ½β·(log ρ)² − A·logp: the same value (IEEE
        # rounding is symmetric)
        value = log_ratio.square().mul_(0.5 * beta).addcmul_(lp, adv, value=-1.0).mul_(mask)
        values = None
        if stats:
            values = ratio_stats(None, adv, mask, None, None, log_ratio, padding=1.0)
        slope = log_ratio.mul_(beta).sub_(adv).mul_(mask)  # ∂ℓ/∂logp = β·log ρ − A
    per_token = linearized(logp, value, slope)
    return per_token, ({} if values is None else to_floats(values))


def _dppo_autograd(logp, old_logp, adv, mask, *, divergence, delta_low, delta_high,
                   clip_ratio_c, log_ratio_clamp, binary_kl_eps):  # fmt: skip
    """DPPO in plain autograd: ``−A·sg(min(ρ, C))·logp`` on the tokens inside the region."""
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    rho = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp))
    p, p_old = torch.exp(lp.detach()), torch.exp(old)
    if divergence == "tv":
        ok_pos, ok_neg = p - p_old <= delta_high, p - p_old >= -delta_low
    else:
        kl = binary_kl(old, lp.detach(), binary_kl_eps)
        ok_pos, ok_neg = (kl <= delta_high) | (p <= p_old), (kl <= delta_low) | (p >= p_old)
    valid = torch.where(a > 0, ok_pos, ok_neg).to(lp.dtype)
    return autograd_masked(-a * rho.clamp(max=clip_ratio_c).detach() * lp * valid, m)


def dppo_tv_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    clip_ratio_c: float = DPPO_TRUNCATION,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """:func:`dppo_tv` in plain autograd."""
    return _dppo_autograd(
        logp, old_logp, adv, mask, divergence="tv", delta_low=delta_low, delta_high=delta_high,
        clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp, binary_kl_eps=BINARY_KL_EPS,
    )  # fmt: skip


def dppo_kl_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    clip_ratio_c: float = DPPO_TRUNCATION,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    binary_kl_eps: float = BINARY_KL_EPS,
) -> torch.Tensor:
    """:func:`dppo_kl` in plain autograd."""
    return _dppo_autograd(
        logp, old_logp, adv, mask, divergence="kl", delta_low=delta_low, delta_high=delta_high,
        clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp, binary_kl_eps=binary_kl_eps,
    )  # fmt: skip


def dro_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float | None = None,
) -> torch.Tensor:
    """:func:`dro` in plain autograd: ``−(A·logp − ½β·(logp − old_logp)²)``."""
    if beta is None or not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"DRO needs beta > 0 (the quadratic penalty weight), got {beta}")
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    return autograd_masked(-(a * lp - 0.5 * beta * (lp - old).square()), m)
