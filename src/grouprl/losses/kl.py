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

__all__ = ["KL_ESTIMATORS", "k1", "k2", "k3", "kl", "token_entropy"]

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


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
}
"""KL estimator name -> function ``(logp [N, T], ref_logp [N, T]) -> [N, T]``."""


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``[N, T]`` of the estimator ``name`` (k1, k2, k3)."""
    try:
        fn = KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {name!r}; valid estimators: {', '.join(KL_ESTIMATORS)}"
        ) from None
    if not isinstance(ref_logp, torch.Tensor) or ref_logp.shape != logp.shape:
        got = tuple(ref_logp.shape) if isinstance(ref_logp, torch.Tensor) else type(ref_logp)
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {got}")
    return fn(logp, ref_logp.detach())


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each position's next-token distribution: ``[N, T, V] -> [N, T]``.

    ``H = logsumexp(z) − Σ softmax(z)·z`` (verl ``entropy_from_logits``), computed in float32.
    """
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
