"""GMPO: the geometric mean of the token ratios as the sequence ratio (ALGORITHMS.md §3).

Signature and ``stats`` as every surrogate (:mod:`grouprl.losses.surrogates`).
"""

from __future__ import annotations

import torch

from grouprl.losses.ratio import (
    apply_gate,
    autograd_inputs,
    autograd_masked,
    beyond_count,
    check_eps,
    check_inputs,
    clamp_log_ratio,
    linearized,
    masked_log_ratio,
    ratio_stats,
    sequence_log_ratio,
)
from grouprl.types import to_floats

__all__ = ["gmpo", "gmpo_autograd", "gmpo_log_ratio"]


def gmpo_log_ratio(
    log_ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Token log-ratios clipped in log space, on the side that limits the update (GMPO eq. 4).

    ``c = clamp(log ρ, −ε_low, ε_high)``, then ``min(log ρ, c)`` where A > 0 and
    ``max(log ρ, c)`` where A ≤ 0: PPO's pessimistic min written in log space (TRL
    ``GMPOTrainer._compute_loss``; verl ``compute_policy_loss_geo_mean`` writes it as
    ``sign(A)·min(sign(A)·log ρ, sign(A)·c)``, the same values; at A = 0 the loss is 0 either way).
    """
    clamped = log_ratio.clamp(-eps_low, eps_high)
    return torch.where(
        adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
    )


def gmpo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    log_ratio_clamp: float | None = None,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: ``ℓ_i = −A_i·exp(mean_t c_it)``, the geometric mean of the clipped token ratios.

    GMPO (Zhao et al. 2025, arXiv 2507.20673) maximises the geometric instead of the arithmetic
    mean of the token ratios, which outliers move far less, and clips each token's log-ratio to
    ``[−ε_low, ε_high]`` in log space (:func:`gmpo_log_ratio`): the ratio range is
    ``(e^−0.4, e^0.4)`` with the paper's ε = 0.4 (TRL ``GMPOConfig.epsilon`` default; the authors'
    ``scripts/qwen2.5-math-7b-gmpo.sh`` sets ``CLIPRANGE=0.4``). verl's ``geo_mean`` reads the
    bounds from ``clip_ratio_low/high``, whose default 0.2 is PPO's, not GMPO's.

    Per token, the GSPO-token form ``−A_i·exp(sg(log s_i) + c_it − sg(c_it))``
    (:func:`sequence_ratio_tokens`): value ``−A_i·s_i`` at every valid token, and with
    ``seq_mean_token_mean`` the loss and its gradient are GMPO's mean over sequences of
    ``−A_i·s_i`` (verl ``core_algos.py:1928-2011`` and TRL ``experimental/gmpo`` take that plain
    mean and ignore ``loss_agg_mode``; verl's ``torch.mean`` also counts rows without a valid
    token, where both give 0). ``log s_i`` divides by ``max(|y_i|, 1)`` (TRL; verl adds 1e-8).
    A per-token advantage ``[N, T]`` is averaged over the sequence's valid tokens, as verl does.
    Neither peer clamps ``log ρ`` (verl's clamp is commented out): ``log_ratio_clamp=None``.
    Clip stats as TRL's GMPO trainer logs them: ``clip_frac_low`` = log ρ < −ε_low with A < 0,
    ``clip_frac_high`` = log ρ > ε_high with A > 0.
    """
    check_eps(eps_low, eps_high)
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():
        log_ratio, clamp_gate = clamp_log_ratio(masked_log_ratio(lp, old, mask), log_ratio_clamp)
        if adv.shape[-1] == 1:  # one clamp with each row's bounds, the values of gmpo_log_ratio
            kw = {"dtype": adv.dtype, "device": adv.device}
            inf, pos = torch.tensor(torch.inf, **kw), adv > 0
            lower = torch.where(pos, -inf, torch.tensor(-eps_low, **kw))
            upper = torch.where(pos, torch.tensor(eps_high, **kw), inf)
            clipped = log_ratio.clamp(lower, upper)  # [N, T], 0 at padding
            seq_adv = adv
        else:
            clipped = gmpo_log_ratio(log_ratio, adv, eps_low, eps_high)  # [N, T]
            seq_adv = sequence_log_ratio(adv, mask)[:, None]  # [N, 1]
        log_seq = clipped.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1.0)
        row = -seq_adv * torch.exp(log_seq)  # [N, 1] −A_i·s_i: the value, its slope in log s_i
        value = row * mask
        values = _stats(log_ratio, adv, mask, eps_low, eps_high, log_seq) if stats else None
        # the GSPO-token gradient runs through each token's clipped log-ratio: 0 where clipped
        slope = clipped.eq_(log_ratio).mul_(row).mul_(mask)
        slope = apply_gate(slope, clamp_gate)
    per_token = linearized(logp, value, slope)
    return per_token, ({} if values is None else to_floats(values))


def gmpo_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """:func:`gmpo` in plain autograd: ``−A_i·exp(sg(log s_i) + c_it − sg(c_it))`` with ``c`` the
    log-space clip (:func:`gmpo_log_ratio`) and ``log s_i`` its mean over the valid tokens."""
    check_eps(eps_low, eps_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    log_ratio = lp - old
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    c = gmpo_log_ratio(log_ratio, a, eps_low, eps_high)  # [N, T]
    log_s = (c * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
    seq_adv = a if a.shape[-1] == 1 else sequence_log_ratio(a, m)[:, None]  # [N, 1]
    return autograd_masked(-seq_adv * torch.exp(log_s.detach() + c - c.detach()), m)


def _stats(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    log_seq: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The token ratio statistics, the clip fractions counted in log space (TRL's GMPO trainer
    counts there), and ``seq_ratio_mean`` (the mean s_i over all sequences)."""
    ratio = torch.exp(log_ratio)
    values = ratio_stats(ratio, adv, mask, None, None, log_ratio, padding=1.0)
    n, scratch = mask.sum(), ratio  # the ratio is done with: its buffer counts
    neg, pos = (adv < 0).to(mask.dtype), (adv > 0).to(mask.dtype)
    # the log-ratio is 0 at padding, within [−ε_low, ε_high]: no mask needed
    low = beyond_count(log_ratio, -eps_low, neg, below=True, scratch=scratch, mask=None)
    high = beyond_count(log_ratio, eps_high, pos, below=False, scratch=scratch, mask=None)
    values["clip_frac_low"] = low / n
    values["clip_frac_high"] = high / n
    values["clip_frac_region"] = (low + high) / n  # A < 0 against A > 0: never both
    values["seq_ratio_mean"] = torch.exp(log_seq).mean()
    return values
