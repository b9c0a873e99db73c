"""Batch ("global") normalisation estimators: reinforce_pp_global, reinforce_pp_baseline,
flash_reinforce and gdpo (ALGORITHMS.md §1, "Global normalisation").

These estimators normalise over the whole batch instead of (or after) each group. The peers
whiten with three different conventions, and weight either every sample or every token
equally; both are named parameters of :func:`whiten`:

- ``weighting="sample"`` (TRL; [OURS] default here, so an estimator needs no lengths) or
  ``"token"`` (verl ``masked_whiten`` and OpenRLHF weight each sequence by its token count:
  outcome advantages broadcast over a sequence's tokens, then whitened over every token);
- ``eps_mode="std"``: (x − μ)/(σ + eps) (TRL ``normalize_then_sum``, trl/trainer/
  grpo_trainer.py ``_generate_and_score_completions``); ``"var"``: (x − μ)·rsqrt(σ² + eps)
  (verl ``verl/utils/torch_functional.py`` ``masked_whiten``, eps 1e-8, Bessel variance);
  ``"var_clamp"``: (x − μ)·rsqrt(max(σ², eps)) (OpenRLHF 0.11 ``trainer/ppo_utils/
  experience_maker.py`` ``compute_advantages_and_returns``, eps 1e-8, population variance).

NaN rewards are left out of every statistic and get advantage 0 (ALGORITHMS.md §0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from grouprl.advantages._groups import (
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    column_range,
    group_count,
    group_moments,
    mask_mean,
    spread_collapsed,
    sum_squares,
    transposed,
    zero_rows_,
    zero_where,
)
from grouprl.advantages.baseline import DEFAULT_DDOF, GRPO_EPS
from grouprl.types import Advantages

__all__ = [
    "EPS_MODES",
    "WEIGHTINGS",
    "flash_reinforce",
    "gdpo",
    "reinforce_pp_baseline",
    "reinforce_pp_global",
    "whiten",
    "whiten_kept_",
    "whiten_scale",
]

EPS_MODES = ("std", "var", "var_clamp")
"""Where the whitening epsilon enters: σ + eps (TRL), √(σ² + eps) (verl), √max(σ², eps)
(OpenRLHF)."""

WEIGHTINGS = ("sample", "token")
"""What one unit of the batch statistics is: a sample (TRL) or a token (verl, OpenRLHF)."""

VERL_WHITEN_EPS = 1e-8
"""verl ``masked_whiten``: ``rsqrt(var + 1e-8)`` (verl/utils/torch_functional.py)."""


def check_whiten_args(weighting: str, eps_mode: str, lengths: torch.Tensor | None) -> None:
    """A ValueError naming the valid choices for a bad ``weighting`` / ``eps_mode``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; valid: {', '.join(WEIGHTINGS)}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"unknown eps_mode {eps_mode!r}; valid: {', '.join(EPS_MODES)}")
    if weighting == "token" and lengths is None:
        raise ValueError(
            "weighting='token' weights each sample by its token count: pass "
            "lengths=[P, G] (completion tokens per sample) to advantages.compute"
        )


def whiten(
    x: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    weights: torch.Tensor | None = None,
    ddof: int = DEFAULT_DDOF,
    eps: float = GRPO_EPS,
    eps_mode: str = "std",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x − μ)/s`` over the valid entries of ``x`` (any shape), weighted by ``weights``.

    μ = Σ w·x / Σ w and σ² = Σ w·(x − μ)² / (Σ w − ddof) over the valid entries (``valid``
    None: all), with ``w`` = ``weights`` (token counts, or a token mask) or 1; s per
    ``eps_mode`` (module docstring). σ² is 0 when Σ w ≤ ddof [OURS: verl raises there].
    Returns ``(whitened, μ [], s [])``; invalid entries of ``whitened`` are 0.
    """
    tiny = torch.finfo(x.dtype).tiny
    if valid is None and weights is None:  # every entry, unit weight: no masks
        x0, n = x, torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)
        mu = x.sum() / n.clamp_min(tiny)  # []
        dev = x - mu
        var = sum_squares(dev) / (n - ddof).clamp_min(tiny)  # no [P, G] square
    elif weights is None:  # a mask, unit weights: the same terms as below, by bit masks
        # [OURS] zero_where instead of torch.where and the float mask's products (each slow on
        # CPU); the masked terms are exact zeros either way, so the sums see the same values
        drop = ~valid
        x0 = zero_where(x.clone(memory_format=torch.contiguous_format), drop)
        n = valid.sum().to(x.dtype)  # [] exact count
        return whiten_kept_(x0, lambda t: zero_where(t, drop), n, ddof, eps, eps_mode)
    else:
        w = valid.to(x.dtype) if weights is None else weights.to(x.dtype)
        if valid is not None and weights is not None:
            w = w * valid
        x0 = x if valid is None else torch.where(valid, x, 0.0)
        n = w.sum()  # []
        mu = (w * x0).sum() / n.clamp_min(tiny)  # []
        dev = x0 - mu
        var = (w * dev).mul_(dev).sum() / (n - ddof).clamp_min(tiny)
    s = whiten_scale(var, n, ddof, eps, eps_mode)
    out = dev.div_(torch.where(s > 0, s, torch.ones_like(s)))  # s = 0 (eps 0, constant batch): 0
    if valid is not None:
        out = zero_where(out, ~valid)
    return out, mu, s


def whiten_kept_(
    x0: torch.Tensor,
    zero_dropped: Callable[[torch.Tensor], torch.Tensor],
    n: torch.Tensor,
    ddof: int,
    eps: float,
    eps_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`whiten` with unit weights of ``x0`` (any shape, already 0 at the dropped
    entries; ``n []`` the kept count in x0's type), in place; returns ``(x0, μ [], s [])``.
    ``zero_dropped(t)`` sets t's dropped entries to +0 in place (a bool or a bit mask, as
    the caller holds it). Σ (x − μ)² by :func:`sum_squares` (no square of x0's size)."""
    tiny = torch.finfo(x0.dtype).tiny
    mu = x0.sum() / n.clamp_min(tiny)  # []
    zero_dropped(x0.sub_(mu))
    var = sum_squares(x0) / (n - ddof).clamp_min(tiny)
    s = whiten_scale(var, n, ddof, eps, eps_mode)
    x0.div_(torch.where(s > 0, s, torch.ones_like(s)))  # s = 0 (eps 0, constant batch): 0
    return x0, mu, s


def whiten_scale(
    var: torch.Tensor, n: torch.Tensor, ddof: int, eps: float, eps_mode: str
) -> torch.Tensor:
    """``s []`` of :func:`whiten` from the variance ``var []`` of ``n []`` (weighted) entries:
    σ² is 0 when ``n <= ddof``, then ``eps`` enters as ``eps_mode`` says (:data:`EPS_MODES`)."""
    var = torch.where(n > ddof, var, torch.zeros_like(var))
    if eps_mode == "std":
        return var.sqrt() + eps
    if eps_mode == "var":
        return (var + eps).sqrt()
    return var.clamp_min(eps).sqrt()


def _result(values, valid, rewards, scale, collapsed, zeroed_groups, **stats) -> Advantages:
    """Advantages of a batch-normalised estimator. ``zeroed_groups [P]`` (or None) get 0;
    ``updated`` = groups with a valid reward that are not zeroed (they all carry a gradient)."""
    p = rewards.shape[0]
    if valid is None:  # every group has G >= 1 valid rewards
        live = torch.ones(p, dtype=torch.bool, device=rewards.device)  # [P]
    else:
        live = group_count(valid, rewards) > 0  # [P]
    if zeroed_groups is not None:  # values is the estimator's own fresh tensor: zeroed in place
        values = zero_rows_(values, zeroed_groups)
        live = live & ~zeroed_groups
    if valid is not None:
        values = values.masked_fill_(~valid, 0.0)
    ones = torch.ones(p, dtype=rewards.dtype, device=rewards.device)
    return Advantages(
        values=values,
        keep=torch.ones(p, dtype=torch.bool, device=rewards.device),
        kl_weight=ones,
        scale=scale.to(rewards.dtype).expand(p).clone(),
        stats={"collapsed_frac": mask_mean(collapsed), **stats},
        updated=live,
    )


def _whitened(x, rewards, valid, m, lengths, weighting, eps_mode, eps, ddof, zero_collapsed):
    """The batch-whitened ``x [P, G]`` as Advantages (collapsed groups zeroed on request)."""
    check_whiten_args(weighting, eps_mode, lengths)
    w = None if weighting == "sample" else lengths.to(rewards.dtype)
    values, mu, s = whiten(x, valid, weights=w, ddof=ddof, eps=eps, eps_mode=eps_mode)
    zeroed = m.collapsed if zero_collapsed else None
    return _result(values, valid, rewards, s, m.collapsed, zeroed, batch_mean=float(mu))


def reinforce_pp_global(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    weighting: str = "sample",
    eps_mode: str = "std",
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """REINFORCE++ without a group baseline: the rewards whitened over the whole batch.

    REINFORCE++ (Hu et al., arXiv 2501.03262 §3, "global advantage normalisation"):
    A = (r − mean_B r)/std_B r; verl ``reinforce_plus_plus`` (trainer/ppo/core_algos.py
    ``compute_reinforce_plus_plus_outcome_advantage``: returns, then ``masked_whiten`` over
    tokens), OpenRLHF 0.11 ``reinforce`` (``compute_advantages_and_returns``: returns, then
    token whitening with the population variance). With outcome rewards and γ = 1 the return
    at every token is the reward, so this sample-level form equals both with
    ``weighting="token", lengths=...`` and their ``eps_mode`` / ``ddof`` (verl: "var", 1;
    OpenRLHF: "var_clamp", 0, eps 1e-8). Token-level rewards (a KL folded into the reward,
    γ < 1) go through ``advantages.compute_tokens``. There is no group baseline, so a group
    whose rewards are all equal is *not* zeroed: it is compared with the batch. ``scale`` =
    the batch scale s; ``stats["collapsed_frac"]`` counts groups with σ_q < tau (no effect).
    """
    m = group_moments(rewards, valid, ddof, tau)
    return _whitened(rewards, rewards, valid, m, lengths, weighting, eps_mode, eps, ddof, False)


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    weighting: str = "sample",
    eps_mode: str = "std",
    zero_collapsed: bool = True,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """REINFORCE++-baseline: u = r_i − r̄_q, then u whitened over the whole batch.

    REINFORCE++ (arXiv 2501.03262 §3, "REINFORCE++ w/ baseline"); verl
    ``reinforce_plus_plus_baseline`` (core_algos.py
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``: ``masked_whiten`` of the
    tiled u over tokens, ``eps_mode="var"``, ddof 1); OpenRLHF 0.11 ``reinforce_baseline``
    (token whitening, ``eps_mode="var_clamp"``, ddof 0, eps 1e-8). Defaults [OURS]: every
    valid sample weighs the same (``weighting="sample"``, no lengths needed), σ + eps, and
    ``zero_collapsed``: a group with σ_q < tau takes part in the batch statistics (its u is
    0) but gets advantage 0; the peers give it (0 − μ_B)/s, a shift that is non-zero when
    the token-weighted mean of u is (``zero_collapsed=False`` reproduces them). This was
    grouprl's ``reinforce_pp`` estimator, which stays as an alias. scale = s.
    """
    m = group_moments(rewards, valid, ddof, tau)
    u = m.dev  # [P, G], 0 at invalid entries
    return _whitened(u, rewards, valid, m, lengths, weighting, eps_mode, eps, ddof, zero_collapsed)


def flash_reinforce(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """FlashREINFORCE: r_i − mean_B r, the batch mean as the only baseline, no whitening.

    OpenRLHF 0.11 ``flash_reinforce`` (``compute_advantages_and_returns``: ``rewards -
    rewards.mean()`` over the rollout batch, no group, no whitening; the single-rollout
    estimator of its README). The mean is over the valid samples. ``ddof`` / ``tau`` only
    enter ``stats["collapsed_frac"]``. scale = 1.
    """
    m = group_moments(rewards, valid, ddof, tau)
    n = group_count(valid, rewards).sum().clamp_min(1).to(rewards.dtype)
    mu = (rewards.nansum() if valid is not None else rewards.sum()) / n  # []
    values = rewards - mu
    return _result(
        values,
        valid,
        rewards,
        torch.ones((), dtype=rewards.dtype, device=rewards.device),
        m.collapsed,
        None,
        batch_mean=float(mu),
    )


GDPO_EPS = 1e-4
"""TRL's epsilon in both GDPO stages (``normalize_then_sum``: ``std + 1e-4``)."""


def gdpo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    weighting: str = "sample",
    eps_mode: str = "std",
    zero_collapsed: bool = True,
    eps: float = GDPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GDPO's second stage: the per-function-normalised sum whitened over the batch.

    GDPO (Liu et al., arXiv 2601.05242 §3): each reward function is normalised within its
    group, the weighted sum is then normalised over the batch. The first stage is the
    reward combination ``normalize_then_sum`` (``advantages.combine``), which
    ``advantages.compute("gdpo", rewards [P, G, K])`` applies by default; this function is
    the second: A = (x − mean_B x)/s. Defaults follow TRL ``multi_objective_aggregation=
    "normalize_then_sum"`` (sample-weighted, std + 1e-4, Bessel); verl ``gdpo``
    (core_algos.py ``compute_gdpo_outcome_advantage``) whitens over tokens with
    ``masked_whiten`` (``weighting="token"``, ``eps_mode="var"``, eps 1e-8).
    ``zero_collapsed`` [OURS]: a group whose combined rewards are all equal (every function
    collapsed in it) gets 0, not the residual (0 − μ_B)/s both peers leave. scale = s.
    """
    if valid is None and rewards.shape[1] <= SORT_NETWORK_MAX:  # the collapse flag alone
        lo, hi = column_range(transposed(rewards).unbind(0))  # [P] each
        m = _Flag(spread_collapsed(rewards, lo, hi, ddof, tau))
    else:
        m = group_moments(rewards, valid, ddof, tau)
    return _whitened(
        rewards, rewards, valid, m, lengths, weighting, eps_mode, eps, ddof, zero_collapsed
    )


class _Flag(NamedTuple):
    """The one field of :class:`~grouprl.advantages._groups.Moments` ``_whitened`` reads."""

    collapsed: torch.Tensor  # [P] bool
