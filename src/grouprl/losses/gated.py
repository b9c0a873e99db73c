"""Surrogates that weight each token by a smooth function of the ratio instead of a hard clip.

- :func:`sapo`: SAPO's sigmoid gate on the token (or sequence) ratio, in place of PPO's clip.
- :func:`vespo`: VESPO's gamma-shaped weight of the *sequence* ratio on a REINFORCE term.

Signature and ``stats`` as every surrogate (:mod:`grouprl.losses.surrogates`); ALGORITHMS.md §3.
"""

from __future__ import annotations

import math

import torch

from grouprl.losses.ratio import (
    LOG_RATIO_CLAMP,
    apply_gate,
    autograd_inputs,
    autograd_masked,
    check_inputs,
    clamp_log_ratio,
    linearized,
    masked_log_ratio,
    ratio_stats,
    valid_sum,
)
from grouprl.types import to_floats

__all__ = [
    "IS_LEVELS",
    "sapo",
    "sapo_autograd",
    "sapo_gate",
    "vespo",
    "vespo_autograd",
    "vespo_weight",
]

IS_LEVELS = ("token", "sequence")
"""Where the importance ratio is taken (TRL ``importance_sampling_level``)."""


def _by_sign(cond: torch.Tensor, yes: float, no: float, like: torch.Tensor) -> torch.Tensor:
    """``where(cond, yes, no)`` in ``like``'s dtype (``torch.where`` on two Python floats would
    give float32 and round 1.05 to 1.0499999523)."""
    kw = {"dtype": like.dtype, "device": like.device}
    return torch.where(cond, torch.tensor(yes, **kw), torch.tensor(no, **kw))


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate ``f(ρ) = σ(τ(ρ − 1))·4/τ`` (SAPO, Gao et al. 2025, the gated objective).

    ``f(1) = 2/τ`` and ``f'(ρ) = 4σ(1 − σ)``, so ``f'(1) = 1``: on-policy the gate's gradient
    equals the unclipped surrogate's, and it decays smoothly as ρ leaves 1 (faster for larger τ).
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    level: str = "token",
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: ``ℓ = −f_τ(ρ)·A``, a soft sigmoid gate on the ratio in place of PPO's clip.

    The gate is :func:`sapo_gate` with τ = τ_pos if A > 0 else τ_neg.

    SAPO (Gao et al. 2025, arXiv 2511.20347) replaces PPO's hard clip by a sigmoid gate whose
    slope τ is larger for negative advantages (τ_neg > τ_pos), so a token pushed down decays
    faster. Defaults τ_pos = 1.0, τ_neg = 1.05: the paper's values, verl ``ActorConfig.tau_pos /
    tau_neg`` and TRL ``sapo_temperature_pos / _neg`` (verl ``compute_policy_loss_sapo``,
    core_algos.py:1622-1704; TRL ``_compute_loss``, grpo_trainer.py:3121-3124). A = 0 takes
    τ_neg, as both peers do (``advantages > 0``).

    ``level="token"`` gates each token's ratio ``exp(clamp(logp − old, ±log_ratio_clamp))``
    (verl clamps at 20, TRL does not; identical below). ``level="sequence"`` gates the
    length-normalised sequence ratio s_i (TRL ``importance_sampling_level="sequence"`` with
    ``loss_type="sapo"``), in the GSPO-token form (:func:`sequence_ratio_tokens`), whose
    gradient equals TRL's broadcast sequence ratio under every aggregation. Both peers
    aggregate SAPO with the per-sequence token mean (verl forces ``seq-mean-token-mean``
    whatever ``loss_agg_mode`` says; TRL's ``sapo`` normalises like ``grpo``); here it composes
    with any aggregation, and the ``sapo`` preset takes ``seq_mean_token_mean``. No clip acts,
    so the clip fractions are 0; extra stat ``gate_mean`` (mean f over valid tokens).
    """
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"SAPO's {name} must be a positive temperature, got {tau}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    tau = _by_sign(adv > 0, tau_pos, tau_neg, adv)  # [N, 1] or [N, T]
    with torch.no_grad():
        log_ratio = masked_log_ratio(lp, old, mask)  # [N, T], 0 at padding
        if level == "token":
            log_ratio, clamp_gate = clamp_log_ratio(log_ratio, log_ratio_clamp)
        else:  # the clamp acts on the value only: the GSPO-token gradient runs through logp
            log_seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1.0)
            log_ratio, clamp_gate = log_seq.clamp(-log_ratio_clamp, log_ratio_clamp), None
        ratio = torch.exp(log_ratio)  # [N, T] ρ or [N, 1] s_i
        sig = _times(torch.sub(ratio, 1.0), tau).sigmoid_()  # σ(τ(ρ − 1)), as sapo_gate
        gate = sig * (4.0 / tau)  # f(ρ) = σ·4/τ
        values = None
        if stats:
            scratch = log_ratio if log_ratio.shape == mask.shape else None
            padding = 1.0 if level == "token" else None  # exp(0) at every padded token
            values = ratio_stats(
                ratio, adv, mask, None, None, log_ratio, padding=padding, scratch=scratch
            )
            values["gate_mean"] = valid_sum(gate, mask) / mask.sum()
        value = _times(_times(gate, -adv), mask)  # −f(ρ)·A, 0 at padding
        # ∂ℓ/∂logp = −A·f'(ρ)·ρ, f'(ρ) = 4σ(1 − σ) = 4(σ − σ²)
        slope = sig.addcmul_(sig, sig, value=-1.0).mul_(ratio).mul_(-4.0 * adv)
        slope = apply_gate(slope, clamp_gate)
    if slope.shape[-1] == 1 and mask.shape[-1] != 1:  # one slope per sequence
        per_token = linearized(logp, value, slope, mask)
    else:
        per_token = linearized(logp, value, _times(slope, mask))
    return per_token, ({} if values is None else to_floats(values))


def sapo_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    level: str = "token",
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """:func:`sapo` in plain autograd: ``−sapo_gate(ρ, τ)·A``, τ = τ_pos where A > 0 else τ_neg;
    at ``level="sequence"`` ρ is the GSPO-token form of the clamped sequence ratio."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    tau = _by_sign(a > 0, tau_pos, tau_neg, a)
    if level == "token":
        rho = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp))
    else:
        log_s = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
        log_s = log_s.clamp(-log_ratio_clamp, log_ratio_clamp)
        rho = torch.exp(log_s.detach() + lp - lp.detach())
    return autograd_masked(-sapo_gate(rho, tau) * a, m)


def _times(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x · y``, in place in ``x`` when the product has ``x``'s shape (``x`` is a buffer of
    the caller's)."""
    return x.mul_(y) if torch.broadcast_shapes(x.shape, y.shape) == x.shape else x * y


VESPO_LOG_W_MIN = math.log(1e-8)
"""``log w`` is clamped from below at log(1e-8) (TRL ``get_gamma_weights``, grpo_trainer.py:2993)."""
VESPO_LOG_W_MAX = 20.0
"""``log w`` is clamped from above at 20 (TRL ``get_gamma_weights``)."""


def vespo_weight(
    log_w: torch.Tensor,
    adv: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    lambda_min: float = 1e-4,
) -> torch.Tensor:
    """VESPO's gamma weight ``φ(w) = e^λ·w^k·e^(−λw)`` (normalised so φ(1) = 1), in log space.

    ``log φ = λ + k·log w − λ·w``; ``(k, λ)`` = ``(k_pos, λ_pos)`` where A ≥ 0, else
    ``(k_neg, λ_neg)``; λ is floored at ``lambda_min`` (TRL ``get_gamma_weights``,
    grpo_trainer.py:2972-3018; VESPO, arXiv 2602.10693). φ peaks at w = k/λ and decays on both
    sides: a small k keeps low-ratio sequences, a large λ cuts high-ratio ones. A non-finite
    φ becomes 0 (TRL's ``nan_to_num``).
    """
    nonneg = adv >= 0
    k = _by_sign(nonneg, k_pos, k_neg, log_w)
    lam = _by_sign(nonneg, lambda_pos, lambda_neg, log_w).clamp_min(lambda_min)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    lambda_min: float = 1e-4,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    log_w_min: float = VESPO_LOG_W_MIN,
    log_w_max: float = VESPO_LOG_W_MAX,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """VESPO: ``ℓ = −sg(φ(w_i))·A·logp`` with the gamma weight of the sequence ratio w_i.

    ``w_i = exp(clamp(Σ_t clamp(logp − old, ±log_ratio_clamp), log_w_min, log_w_max))``: the
    *product* of the token ratios (a sum of log-ratios, not GSPO's mean), weighted by
    :func:`vespo_weight` and detached, on a REINFORCE term (VESPO, arXiv 2602.10693; TRL
    ``loss_type="vespo"``, grpo_trainer.py:3125-3136, defaults k 2/3 and λ 3/2 for A ≥ 0 / A < 0
    from ``GRPOConfig.vespo_*``). TRL aggregates it with the step's token mean (``vespo`` is
    normalised like ``dapo``): the ``vespo`` preset takes ``token_mean``. When TRL runs vLLM it
    also folds the rollout-vs-trainer ratio into w; that correction is not part of this
    surrogate. No clip: clip fractions are 0; extra stat ``phi_mean`` (mean φ over valid
    tokens; TRL's ``vespo/phi_seq_mean`` is the mean over sequences).
    """
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg), ("lambda_pos", lambda_pos)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"VESPO's {name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(lambda_neg) and lambda_neg >= 0 and lambda_min > 0):
        raise ValueError(
            f"VESPO's lambda_neg must be >= 0 and lambda_min > 0, got {lambda_neg}, {lambda_min}"
        )
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():  # the weight carries no gradient: only logp does
        log_ratio = masked_log_ratio(lp, old, mask).clamp_(-log_ratio_clamp, log_ratio_clamp)
        log_w = log_ratio.sum(dim=-1, keepdim=True).clamp(log_w_min, log_w_max)  # [N, 1]
        phi = vespo_weight(
            log_w,
            adv,
            k_pos=k_pos,
            lambda_pos=lambda_pos,
            k_neg=k_neg,
            lambda_neg=lambda_neg,
            lambda_min=lambda_min,
        )  # [N, 1] or [N, T]
        coef = -phi * adv  # [N, 1] or [N, T]: the slope of −sg(φ)·A·logp
        value = torch.mul(lp, coef).mul_(mask)  # 0 at padding
        values = None
        if stats:
            values = ratio_stats(  # the ratio goes into log_ratio's buffer
                None, adv, mask, None, None, log_ratio, padding=1.0, scratch=log_ratio
            )
            values["phi_mean"] = valid_sum(phi, mask) / mask.sum()
    if coef.shape[-1] == 1 and mask.shape[-1] != 1:
        per_token = linearized(logp, value, coef, mask)
    else:
        per_token = linearized(logp, value, coef * mask)
    return per_token, ({} if values is None else to_floats(values))


def vespo_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    lambda_min: float = 1e-4,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    log_w_min: float = VESPO_LOG_W_MIN,
    log_w_max: float = VESPO_LOG_W_MAX,
) -> torch.Tensor:
    """:func:`vespo` in plain autograd: ``−sg(φ(w_i))·A·logp`` with ``log w_i`` the clamped sum
    of the clamped token log-ratios."""
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    log_ratio = (lp - old).clamp(-log_ratio_clamp, log_ratio_clamp) * m
    log_w = log_ratio.sum(-1, keepdim=True).clamp(log_w_min, log_w_max)  # [N, 1]
    phi = vespo_weight(
        log_w, a, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg,
        lambda_min=lambda_min,
    ).detach()  # fmt: skip
    return autograd_masked(-phi * a * lp, m)
