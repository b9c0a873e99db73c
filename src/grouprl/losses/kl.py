"""Per-token KL estimators to a reference policy, and the token entropy (ALGORITHMS.md §3).

Each estimator maps ``logp, ref_logp: [N, T]`` to ``[N, T]`` (Schulman 2020, "Approximating
KL divergence"; names and clamps as verl ``kl_penalty_forward``). The KL term enters the loss
as ``β·kl_weight_q·KL`` *outside* every advantage scaling (MaxNorm's point: dividing the
reward branch by s_q must not rescale the KL branch); :func:`grouprl.losses.objective`
assembles it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grouprl.losses.ratio import apply_gate, clamp_log_ratio, linearized

__all__ = [
    "KL_ALIASES",
    "KL_CORRECTIONS",
    "KL_ESTIMATORS",
    "KL_IS_WEIGHT_CLIP",
    "KL_VARIANTS",
    "STRAIGHT_THROUGH",
    "corrected_value_slope",
    "k1",
    "k2",
    "k3",
    "kl",
    "kl_abs",
    "kl_autograd",
    "kl_corrected",
    "kl_corrected_autograd",
    "kl_names",
    "kl_value_slope",
    "resolve_kl",
    "straight_through_k2",
    "token_entropy",
]

K3_LOG_RATIO_CLAMP = 20.0
"""``ref − logp`` is clamped to ±20 before ``exp`` in k3 (verl ``low_var_kl``)."""
K3_CLAMP = 10.0
"""The k3 value is clamped to ±10 (verl ``low_var_kl``)."""


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp − ref_logp: unbiased for KL(π‖π_ref) under π's samples, high variance."""
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½(logp − ref_logp)²: low variance, biased value; on-policy, its expected gradient is ∇KL.

    verl calls it ``"mse"``.
    """
    return 0.5 * (logp - ref_logp).square()


def k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    log_ratio_clamp: float = K3_LOG_RATIO_CLAMP,
    clamp: float = K3_CLAMP,
) -> torch.Tensor:
    """k3 = exp(ref − logp) − (ref − logp) − 1 ≥ 0, clamped to ±10 (verl ``low_var_kl``; GRPO).

    ``ref − logp`` is clamped to ±``log_ratio_clamp`` (20) before ``exp``, and the result to
    ±``clamp`` (10), both as verl does; TRL's GRPO ``beta`` term is the same formula without the
    clamps (identical while k3 < 10).
    """
    d = (ref_logp - logp).clamp(-log_ratio_clamp, log_ratio_clamp)
    return (torch.exp(d) - d - 1.0).clamp(-clamp, clamp)


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp − ref_logp|: the absolute log-ratio (verl ``"abs"``), ≥ 0, biased as a KL value."""
    return (logp - ref_logp).abs()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "abs": kl_abs,
}
"""KL estimator name -> function ``(logp [N, T], ref_logp [N, T]) -> [N, T]``."""

KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's other names for the same estimators (``kl_penalty_forward``, core_algos.py:2216-2251)."""

STRAIGHT_THROUGH = "+"
"""Suffix of verl's straight-through names (``k1+``, ``k3+``, ``abs+``...): the value of the
named estimator, the gradient of k2 (verl ``kl_penalty``, core_algos.py:2188-2213)."""

KL_CORRECTIONS: dict[str, str] = {
    "ratio": "rho·KL, rho = pi/pi_old per token, with its gradient (TRL use_bias_correction_kl)",
    "sequence_ratio": "s·KL with the sequence ratio s (TRL, importance_sampling_level=sequence)",
    "straight_through": "the KL value, the gradient of sg(min(rho, 10))·k2 (OpenRLHF "
    "kl.unbiased_gradient)",
}
"""Importance corrections of the KL term for updates taken off the behaviour policy
(:func:`kl_corrected`), with one line each (``grouprl list kl_corrections``)."""

KL_IS_WEIGHT_CLIP = 10.0
"""Cap on the detached weight π/π_old of the ``straight_through`` correction (OpenRLHF
``KL_IS_WEIGHT_CLIP``, models/utils.py:67)."""


KL_VARIANTS: dict[str, str] = {
    **{alias: f"verl's name for {base}" for alias, base in KL_ALIASES.items()},
    **{
        name + STRAIGHT_THROUGH: f"the value of {name}, the gradient of k2 (verl straight-through)"
        for name in [*KL_ESTIMATORS, *KL_ALIASES]
    },
}
"""Every other name :func:`kl` accepts, with what it means (``grouprl list kl_names``)."""


def kl_names() -> list[str]:
    """Every name :func:`kl` accepts: estimators, verl's aliases, and each with ``+``."""
    base = [*KL_ESTIMATORS, *KL_ALIASES]
    return [*base, *(n + STRAIGHT_THROUGH for n in base)]


def resolve_kl(name: str) -> tuple[str, bool]:
    """``(estimator, straight_through)`` for a KL name: ``"low_var_kl+"`` -> ``("k3", True)``."""
    if not isinstance(name, str):
        raise ValueError(f"a KL estimator name must be a string, got {type(name).__name__}")
    straight = name.endswith(STRAIGHT_THROUGH)
    base = name[: -len(STRAIGHT_THROUGH)] if straight else name
    base = KL_ALIASES.get(base, base)
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid names: {', '.join(kl_names())}")
    return base, straight


def straight_through_k2(
    value: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor
) -> torch.Tensor:
    """``value`` forward, the gradient of k2 = ½(logp − ref)² backward: ``(logp − ref)·∇logp``.

    k1 and k3 are unbiased KL *values* under π's samples but their expected gradients are not
    ∇KL; k2's is (on-policy). verl's ``+`` names bind the two (Schulman 2020; verl ``kl_penalty``).
    """
    surrogate = k2(logp, ref_logp)
    return value.detach() + surrogate - surrogate.detach()


@torch.no_grad()
def kl_value_slope(
    name: str, logp: torch.Tensor, ref_logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, slope)`` of the KL estimator ``name`` (any name :func:`kl` takes): the
    per-token estimate ``[N, T]`` and its derivative ``∂KL_t/∂logp_t``, without a graph.

    k1: ``logp − ref``, slope 1; k2: ``½(logp − ref)²``, slope ``logp − ref``; k3 (clamped as
    verl, :func:`k3`): ``e^d − d − 1`` with ``d = ref − logp``, slope ``1 − e^d`` where neither
    clamp acts, else 0; abs: ``|logp − ref|``, slope ``sign(logp − ref)``; a ``+`` name: the
    estimator's value with k2's slope (verl's straight-through). The same values as
    :data:`KL_ESTIMATORS`, bit for bit; the slopes are autograd's derivatives of them.
    """
    base, straight = resolve_kl(name)
    diff = logp - ref_logp  # [N, T]
    if base == "k1":
        value, slope = diff, torch.ones((), dtype=diff.dtype, device=diff.device)
    elif base == "k2":
        value, slope = 0.5 * diff.square(), diff
    elif base == "abs":
        value, slope = diff.abs(), diff.sign()
    else:  # k3, clamped as k3() does; a clamp that acts zeroes the slope (gate)
        d, gate = clamp_log_ratio(ref_logp - logp, K3_LOG_RATIO_CLAMP)
        e = torch.exp(d)
        value, value_gate = clamp_log_ratio(e - d - 1.0, K3_CLAMP)
        slope = apply_gate(e.sub_(1.0).neg_(), gate, value_gate)  # ∂(e^d − d − 1)/∂logp
    if straight:
        slope = diff
    return value, slope


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``[N, T]`` of ``name``: k1, k2, k3, abs, verl's aliases (kl, mse,
    low_var_kl), and any of them with ``+`` (value of the estimator, gradient of k2).

    Computed by :func:`kl_value_slope` and attached to ``logp``'s graph by
    :func:`grouprl.losses.ratio.linearized` (first-order gradient)."""
    resolve_kl(name)
    if not isinstance(ref_logp, torch.Tensor) or ref_logp.shape != logp.shape:
        got = tuple(ref_logp.shape) if isinstance(ref_logp, torch.Tensor) else type(ref_logp)
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {got}")
    value, slope = kl_value_slope(name, logp.detach(), ref_logp.detach())
    return linearized(logp, value, slope)


def kl_autograd(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """:func:`kl` in plain autograd (the readable form): :data:`KL_ESTIMATORS`'s function of the
    name's estimator, and for a ``+`` name its value with k2's gradient
    (:func:`straight_through_k2`). ``tests/losses/test_autograd_forms.py`` holds :func:`kl`
    equal to it for every name of :func:`kl_names`, value and gradient."""
    base, straight = resolve_kl(name)
    value = KL_ESTIMATORS[base](logp, ref_logp)
    return straight_through_k2(value, logp, ref_logp) if straight else value


@torch.no_grad()
def corrected_value_slope(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    correction: str,
    weight_clip: float = KL_IS_WEIGHT_CLIP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, slope)`` of :func:`kl_corrected` for the element-wise corrections
    (``"ratio"``: ``ρ·KL``, slope ``ρ·(KL + KL')``; ``"straight_through"``: the value of KL,
    slope ``min(ρ, weight_clip)·(logp − ref)``), without a graph. ``"sequence_ratio"`` couples
    the tokens of a sequence through s_i and has no per-token slope: :func:`kl_corrected`
    keeps autograd for it."""
    value, slope = kl_value_slope(name, logp, ref_logp)
    ratio = torch.exp(logp - old_logp)  # [N, T]
    if correction == "ratio":
        return ratio * value, (value + slope).mul_(ratio)  # d(ρ·KL) = ρ·KL + ρ·KL'
    if correction == "straight_through":
        return value, ratio.clamp_(max=weight_clip).mul_(logp - ref_logp)
    raise ValueError(f"correction {correction!r} has no per-token slope; use kl_corrected")


def kl_corrected(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    correction: str,
    weight_clip: float = KL_IS_WEIGHT_CLIP,
) -> torch.Tensor:
    """The KL term ``[N, T]`` with an importance correction for tokens sampled from π_old.

    A KL loss evaluated on π_old's samples has the expected gradient of the reverse KL only
    on-policy. The peers' readings of the fix (DeepSeek-V3.2, arXiv 2512.02556, whose unbiased
    KL estimate TRL's ``GRPOConfig.use_bias_correction_kl`` cites):

    - ``"ratio"``: ``ρ·KL`` with ``ρ = π/π_old`` per token, ρ carrying its gradient (TRL
      ``use_bias_correction_kl``, grpo_trainer.py:3101-3107). For k3 the gradient is then
      ``ρ·(logp − ref)·∇logp`` (d(ρ·k3) = ρ·k3·∇logp + ρ·(1 − e^(ref − logp))·∇logp); the
      value is ρ·k3. On-policy ρ = 1 but its gradient is ∇logp, so the KL gradient changes there
      too (TRL's doc says so).
    - ``"sequence_ratio"``: the same with the sequence ratio ``exp(mean_t log ρ)`` broadcast
      over the tokens (TRL with ``importance_sampling_level="sequence"``).
    - ``"straight_through"``: the value of the estimator, the gradient of
      ``sg(min(ρ, weight_clip))·k2`` = ``w·(logp − ref)·∇logp`` (OpenRLHF
      ``compute_approx_kl(..., unbiased_gradient=True)``, models/utils.py:70-128, w capped at
      :data:`KL_IS_WEIGHT_CLIP`): every estimator then has the same, unbiased gradient. With
      ``old_logp=None``, w = 1: verl's ``k*+`` gradient.

    ``old_logp=None`` means on-policy (``logp.detach()``). The ratio and straight-through forms
    are element-wise (:func:`corrected_value_slope`, attached by ``linearized``); the sequence
    ratio runs through autograd.
    """
    if correction not in KL_CORRECTIONS:
        raise ValueError(
            f"unknown KL correction {correction!r}; valid corrections: {', '.join(KL_CORRECTIONS)}"
        )
    if correction == "straight_through" and not weight_clip > 0:
        raise ValueError(f"kl_weight_clip must be > 0, got {weight_clip}")
    old = logp.detach() if old_logp is None else old_logp.detach()
    if correction == "sequence_ratio":
        value = kl(name, logp, ref_logp)
        m = mask.to(logp.dtype)
        log_ratio = logp - old  # [N, T]
        log_seq = (log_ratio * m).sum(dim=-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        return torch.exp(log_seq) * value
    resolve_kl(name)
    if not isinstance(ref_logp, torch.Tensor) or ref_logp.shape != logp.shape:
        got = tuple(ref_logp.shape) if isinstance(ref_logp, torch.Tensor) else type(ref_logp)
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {got}")
    value, slope = corrected_value_slope(
        name, logp.detach(), ref_logp.detach(), old, correction=correction, weight_clip=weight_clip
    )
    return linearized(logp, value, slope)


def kl_corrected_autograd(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    correction: str,
    weight_clip: float = KL_IS_WEIGHT_CLIP,
) -> torch.Tensor:
    """:func:`kl_corrected` in plain autograd: ``ρ·KL`` (``"ratio"``), ``s·KL`` with the
    sequence ratio (``"sequence_ratio"``), or the KL value with the gradient of
    ``sg(min(ρ, weight_clip))·k2`` (``"straight_through"``), KL = :func:`kl_autograd`."""
    if correction not in KL_CORRECTIONS:
        raise ValueError(
            f"unknown KL correction {correction!r}; valid corrections: {', '.join(KL_CORRECTIONS)}"
        )
    old = logp.detach() if old_logp is None else old_logp.detach()
    log_ratio = logp - old  # [N, T]
    if correction == "ratio":
        return torch.exp(log_ratio) * kl_autograd(name, logp, ref_logp)
    if correction == "sequence_ratio":
        m = mask.to(logp.dtype)
        log_seq = (log_ratio * m).sum(dim=-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        return torch.exp(log_seq) * kl_autograd(name, logp, ref_logp)
    value = KL_ESTIMATORS[resolve_kl(name)[0]](logp, ref_logp)
    w = torch.exp(log_ratio).clamp(max=weight_clip).detach()
    surrogate = w * k2(logp, ref_logp)
    return value.detach() + surrogate - surrogate.detach()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each position's next-token distribution: ``[N, T, V] -> [N, T]``.

    ``H = logsumexp(z) − Σ softmax(z)·z`` (verl ``entropy_from_logits``), computed in float32.
    """
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
