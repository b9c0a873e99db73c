"""What every surrogate shares: input checks, the importance ratio, ratio statistics.

The surrogates (``surrogates.py`` and the family files next to it) take the same inputs
(``logp, old_logp: [N, T]``, ``adv: [N]`` or ``[N, T]``, ``mask: [N, T]``) and report the same
ratio statistics, so both live here, in one place (ALGORITHMS.md §3).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "Eps",
    "check_eps",
    "check_inputs",
    "eps_column",
    "masked_mean",
    "ratio_stats",
    "sequence_log_ratio",
    "sequence_ratio_tokens",
]

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before ``exp`` (verl ``compute_policy_loss_vanilla``)."""


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate surrogate inputs; return ``(logp, old_logp, adv [N, 1] or [N, T], mask float)``.

    Raises ValueError for: non-tensors, ``logp`` not 2-D ``[N, T]``, ``old_logp`` / ``mask`` of
    another shape, ``adv`` neither ``[N]`` nor ``[N, T]``, a mask with no valid token, and
    non-finite ``logp`` / ``old_logp`` / ``adv`` at valid positions. Masked positions are
    zero-filled so that padding never produces NaN (ALGORITHMS.md §3 inputs); float16 /
    bfloat16 inputs are computed in float32.
    """
    for name, t in (("logp", logp), ("adv", adv), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logp.dim() != 2:
        raise ValueError(
            f"logp must be [N sequences, T tokens], got shape {_shape(logp)}; "
            "a single sequence needs logp.unsqueeze(0)"
        )
    if old_logp is None:
        old_logp = logp.detach()
    if not isinstance(old_logp, torch.Tensor) or old_logp.shape != logp.shape:
        got = _shape(old_logp) if isinstance(old_logp, torch.Tensor) else type(old_logp).__name__
        raise ValueError(
            f"old_logp must have the shape of logp {_shape(logp)}, got {got}; both are the "
            "per-token log-probabilities of the same completion tokens"
        )
    if mask.shape != logp.shape:
        raise ValueError(
            f"mask must have the shape of logp {_shape(logp)}, got {_shape(mask)}; pass the "
            "completion mask (1 = real token), not the prompt+completion attention mask"
        )
    n = logp.shape[0]
    if adv.shape == (n,):
        adv = adv[:, None]  # [N, 1]
    elif adv.shape != logp.shape:
        raise ValueError(
            f"adv must be [N]={n} (one advantage per sequence) or [N, T]={_shape(logp)}, got "
            f"{_shape(adv)}; flatten a [P, G] advantage with Advantages.per_sample"
        )
    valid = mask.bool()
    if not bool(mask.sum() > 0):  # a float sum: faster than any() on a bool tensor on CPU
        raise ValueError(
            "mask has no valid token (all zero): the loss would be 0/0; drop empty batches "
            "before the loss, or pass StepTotals to aggregate() for an empty micro-batch"
        )
    if not torch.isfinite(adv.detach()).all():
        raise ValueError(
            "adv has non-finite values; advantages of NaN rewards must be 0 (see "
            "grouprl.advantages), never NaN"
        )
    # half-precision log-probs are upcast: exp(logp - old_logp) in bf16 has ~3 significant
    # digits, far coarser than a 0.2 clip range [OURS]
    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    logp = torch.where(valid, logp.to(dtype), zero)
    old_logp = torch.where(valid, old_logp.detach().to(dtype), zero)
    # padding is 0 now, so the valid positions are finite iff the sums are: one reduction per
    # tensor in the common case (log-probabilities cannot overflow a float sum), the count only
    # for the error message
    if not bool(torch.isfinite(logp.detach().sum() + old_logp.sum())):
        for name, t in (("logp", logp), ("old_logp", old_logp)):
            finite = torch.isfinite(t.detach())
            if not finite.all():
                raise ValueError(
                    f"{name} has {int((~finite).sum())} non-finite value(s) at valid (mask = 1) "
                    "positions; check the model's logits (fp16 overflow?) and the mask alignment"
                )
    return logp, old_logp, adv.detach().to(dtype), valid.to(dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens (``mask`` float, at least one valid token)."""
    return (x * mask).sum() / mask.sum()


@torch.no_grad()
def ratio_stats(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    lo: float | torch.Tensor | None,
    hi: float | torch.Tensor | None,
    log_ratio: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Ratio and clip statistics over valid tokens (TRL GRPOTrainer's clip_ratio/* metrics).

    Fractions are counts of boolean tensors over the valid-token count; a bound that is None
    gives a zero fraction without a pass over the batch.
    """
    valid = mask.bool()
    n = mask.sum()
    r = ratio.detach().expand_as(mask)
    inf = torch.tensor(torch.inf, dtype=r.dtype, device=r.device)
    stats = {
        "ratio_mean": (r * mask).sum() / n,
        "ratio_min": torch.where(valid, r, inf).amin(),
        "ratio_max": torch.where(valid, r, -inf).amax(),
        "approx_kl": -(log_ratio.detach() * mask).sum() / n,
    }
    zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
    low = (r < lo) & (adv < 0) & valid if lo is not None else None
    high = (r > hi) & (adv > 0) & valid if hi is not None else None
    stats["clip_frac_low"] = zero if low is None else low.sum() / n
    stats["clip_frac_high"] = zero if high is None else high.sum() / n
    either = low if high is None else high if low is None else low | high
    stats["clip_frac_region"] = zero if either is None else either.sum() / n
    return stats


Eps = float | torch.Tensor
"""A clip bound: one float, or one per sequence (``[N]``)."""


def _eps_ok(e: Eps) -> bool:
    """Finite and >= 0 (a float, or every entry of a per-sequence tensor)."""
    if isinstance(e, torch.Tensor):
        return bool(((e >= 0) & torch.isfinite(e)).all())
    return math.isfinite(float(e)) and float(e) >= 0


def check_eps(eps_low: Eps, eps_high: Eps) -> None:
    ok = _eps_ok(eps_low) and _eps_ok(eps_high)
    if not ok:
        raise ValueError(f"clip bounds must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")


def eps_column(eps: Eps, n: int, like: torch.Tensor) -> float | torch.Tensor:
    """A float stays a float; a per-sequence ``[N]`` tensor becomes ``[N, 1]``."""
    if not isinstance(eps, torch.Tensor):
        return float(eps)
    if eps.shape != (n,):
        raise ValueError(
            f"a tensor clip bound must be [N]={n} (one per sequence, e.g. AGPO's per-prompt "
            f"epsilon repeated G times), got {tuple(eps.shape)}"
        )
    return eps.detach().to(like.dtype)[:, None]


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T] -> [N]``: the mean of the per-token log-ratios over each sequence's valid tokens.

    ``log s_i = Σ_t m_it·log ρ_it / max(|y_i|, 1)`` (GSPO's length-normalised sequence ratio;
    TRL ``importance_sampling_level="sequence"`` divides by ``mask.sum(-1).clamp(min=1)``).
    """
    return (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)


def sequence_ratio_tokens(log_seq: torch.Tensor, token_part: torch.Tensor) -> torch.Tensor:
    """``[N], [N, T] -> [N, T]``: the token-trick form of a sequence-level log-ratio.

    ``sg(log s_i) + x_it − sg(x_it)`` (GSPO-token, Zheng et al. 2025 §4.3): its value is
    ``log s_i`` at every token, and the gradient at token t is ``∇x_it``. Summed over a
    sequence with one weight per sequence (every aggregation), ``f(exp(·))`` then has the value
    and the gradient of the sequence-level ``f(s_i)`` whenever ``∇ log s_i = Σ_t ∇x_it / |y_i|``
    and the sequence's tokens are averaged, as for ``x = logp`` (GSPO) or the clipped log-ratio
    (GMPO).
    """
    return log_seq.detach()[:, None] + token_part - token_part.detach()
