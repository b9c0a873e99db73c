"""Policy-gradient surrogates: per-token losses to be minimised (ALGORITHMS.md §3).

Every surrogate has the signature ``f(logp, old_logp, adv, mask, **params) -> (per_token,
stats)``:

- ``logp``: ``[N, T]`` log-probabilities of the sampled tokens under the current policy
  (carries the gradient);
- ``old_logp``: ``[N, T]`` the behaviour policy's log-probabilities (no gradient is taken
  through it; ``None`` means on-policy, i.e. ``logp.detach()``);
- ``adv``: ``[N]`` one advantage per sequence (a ``[N, T]`` per-token advantage is accepted
  too, e.g. for PPO with a critic);
- ``mask``: ``[N, T]`` 1 / True for real completion tokens.

``per_token`` is ``[N, T]`` and exactly 0 at masked positions; turn it into a scalar with
:func:`grouprl.losses.aggregate`. ``stats`` are plain floats over the valid tokens:
``ratio_mean / ratio_min / ratio_max``, ``clip_frac_low`` (A < 0 and ρ < 1 − ε_low: the
token's gradient is cut), ``clip_frac_high`` (A > 0 and ρ > 1 + ε_high), ``clip_frac_region``
(either), as TRL's GRPOTrainer logs them, and ``approx_kl`` = token-mean of old − new
log-probability (verl's ``ppo_kl``).

Masked positions are replaced by 0 before any arithmetic, so padding that holds ``-inf`` or
NaN never leaks a NaN into the loss or its gradient. A non-finite value at a *valid* position
is an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grouprl.losses.covariance import clip_cov, clip_cov_autograd, kl_cov, kl_cov_autograd
from grouprl.losses.gated import sapo, sapo_autograd, vespo, vespo_autograd
from grouprl.losses.geometric import gmpo, gmpo_autograd
from grouprl.losses.ratio import (
    LOG_RATIO_CLAMP,
    Eps,
    apply_gate,
    autograd_inputs,
    autograd_masked,
    check_eps,
    check_inputs,
    clamp_log_ratio,
    eps_column,
    linearized,
    masked_log_ratio,
    pessimistic_bounds,
    ratio_stats,
)
from grouprl.losses.topr import topr, topr_autograd
from grouprl.losses.trust_region import (
    dppo_kl,
    dppo_kl_autograd,
    dppo_tv,
    dppo_tv_autograd,
    dro,
    dro_autograd,
)
from grouprl.types import to_floats

__all__ = [
    "AUTOGRAD_FORMS",
    "CLIPPED",
    "SURROGATES",
    "ZERO_AT_ZERO_ADVANTAGE",
    "check_inputs",
    "cispo",
    "cispo_autograd",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "gmpo",
    "gspo",
    "gspo_autograd",
    "kl_cov",
    "on_policy_note",
    "on_policy_warning",
    "ppo_clip",
    "ppo_clip_autograd",
    "reinforce",
    "reinforce_autograd",
    "sapo",
    "surrogate",
    "topr",
    "vespo",
]


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Eps = 0.2,
    eps_high: Eps = 0.2,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric bounds (clip-higher) and optional dual clip.

    ``ρ = exp(clamp(logp − old_logp, ±log_ratio_clamp))``;
    ``ℓ = −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A)`` [PPO; GRPO ε = 0.2/0.2; DAPO
    clip-higher 0.2/0.28]. Dual clip (Ye et al. 2020, verl ``clip_ratio_c`` = 3.0): for A < 0
    the loss is further capped, ``ℓ = min(ℓ, −c·A)``, so a huge ρ on a bad token cannot blow
    up the step. ``clip_ratio_c=None`` (default, as TRL) turns it off; it must be > 1.
    ``eps_low`` / ``eps_high`` may be ``[N]`` tensors (one bound per sequence: AGPO's
    per-prompt adaptive ε, :class:`grouprl.control.agpo.AdaptiveClip`).
    ``log_ratio_clamp`` = 20 as in verl (TRL does not clamp; identical for |log ρ| < 20).
    Extra stat: ``clip_frac_dual`` (verl ``pg_clipfrac_lower``). ``stats=False``: no
    statistics (an empty dict), the loss alone.

    The pessimistic min is one clamp of ρ with each row's bounds
    (:func:`~grouprl.losses.ratio.pessimistic_bounds`), the same values bit for bit; the
    gradient ``−A·ρ`` where the clip is inactive, 0 elsewhere, is attached by
    :func:`~grouprl.losses.ratio.linearized`.
    """
    check_eps(eps_low, eps_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c (dual clip) must be > 1 (verl uses 3.0), got {clip_ratio_c}"
        )
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    lo = 1.0 - eps_column(eps_low, lp.shape[0], lp)  # float or [N, 1]
    hi = 1.0 + eps_column(eps_high, lp.shape[0], lp)
    with torch.no_grad():
        log_ratio, gate = clamp_log_ratio(masked_log_ratio(lp, old, mask), log_ratio_clamp)
        ratio = torch.exp(log_ratio)  # [N, T], 1 at padding
        lower, upper = pessimistic_bounds(adv, lo, hi, clip_ratio_c)  # [N, 1] (or [N, T])
        value = ratio.clamp(lower, upper)
        inside = value == ratio  # where the clip is inactive and the gradient runs
        value.mul_(-adv).mul_(mask)  # [N, T] −A·clip(ρ), 0 at padding
        values = None
        if stats:  # before the ratio's buffer becomes the slope
            values = ratio_stats(
                ratio, adv, mask, lo, hi, log_ratio, cap=clip_ratio_c, padding=1.0,
                scratch=log_ratio,
            )  # fmt: skip
        slope = ratio.mul_(-adv).mul_(mask).mul_(inside)  # ∂ℓ/∂logp: −A·ρ inside, else 0
        slope = apply_gate(slope, gate)
    return linearized(logp, value, slope), ({} if values is None else to_floats(values))


def ppo_clip_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Eps = 0.2,
    eps_high: Eps = 0.2,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """:func:`ppo_clip`'s per-token loss ``[N, T]`` in plain autograd (the readable form):
    ``max(−Aρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))``, then ``min(·, −c·A)`` where A < 0."""
    check_eps(eps_low, eps_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    lo = 1.0 - eps_column(eps_low, lp.shape[0], lp)  # float or [N, 1]
    hi = 1.0 + eps_column(eps_high, lp.shape[0], lp)
    rho = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp))  # [N, T]
    loss = torch.maximum(-a * rho, -a * torch.clamp(rho, lo, hi))
    if clip_ratio_c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_ratio_c), loss)
    return autograd_masked(loss, m)


def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 5.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: clipped, stop-gradient importance weight on every token; no token is dropped.

    ``ℓ = −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·logp`` (MiniMax-M1; verl
    ``compute_policy_loss_cispo``). The gradient is ``−sg(w)·A·∇logp`` for every token, also
    where ρ is outside the bounds (PPO would give 0 there). Defaults ε_low = 1.0, ε_high = 5.0
    (weight in [0, 6]) as F-GRPO and ScaleRL use. TRL's ``loss_type="cispo"`` clamps only from
    above at ``epsilon_high`` (an absolute bound): our ``eps_low=1.0`` (lower bound 0, never
    active) and ``eps_high = epsilon_high − 1`` reproduce it. Clip stats count where the
    weight is clipped (low: ρ < 1 − ε_low, high: ρ > 1 + ε_high), for either sign of A.
    """
    check_eps(eps_low, eps_high)
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():  # the weight carries no gradient: only logp does
        log_ratio = masked_log_ratio(lp, old, mask).clamp_(-log_ratio_clamp, log_ratio_clamp)
        ratio = torch.exp(log_ratio)  # [N, T]
        coef = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).neg_().mul_(adv)  # −sg(w)·A
        slope = coef.mul_(mask)  # the gradient of −sg(w)·A·logp, 0 at padding
        value = slope * lp
        values = None
        if stats:
            values = ratio_stats(
                ratio, adv, mask, 1.0 - eps_low, 1.0 + eps_high, log_ratio, any_sign=True,
                padding=1.0, scratch=log_ratio,
            )  # fmt: skip
    return linearized(logp, value, slope), ({} if values is None else to_floats(values))


def cispo_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 5.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """:func:`cispo` in plain autograd: ``−sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·logp``."""
    check_eps(eps_low, eps_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    rho = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp))
    w = rho.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    return autograd_masked(-w * a * lp, m)


def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    log_ratio_max: float = 10.0,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO clip on the length-normalised sequence ratio s_i.

    ``s_i = exp(mean_t(logp − old_logp))`` over the sequence's valid tokens (GSPO, Zheng et
    al. 2025); in the GSPO-token form used here (and by verl ``compute_policy_loss_gspo`` and
    TRL ``importance_sampling_level="sequence"``) each token carries
    ``s_{i,t} = sg(s_i)·exp(logp_t − sg(logp_t))``: the value equals s_i and, with a
    per-sequence advantage, the gradient of the per-sequence token mean equals the gradient
    of ``−min(s_i A, clip(s_i, 1 − ε_low, 1 + ε_high)A)``. ``log s`` is clamped from above at
    ``log_ratio_max`` = 10 (verl). Defaults ε = 3e-4 / 4e-4 (GSPO paper). Use it with
    ``seq_mean_token_mean`` to match the paper's sequence-level objective.

    Here the value ``−A·clip(s_i)`` and the GSPO-token gradient ``−A·s_i·∇logp_t`` (0 where
    the clip or the cap acts) are computed from the ``[N]`` values s_i and attached by
    :func:`~grouprl.losses.ratio.linearized`: no ``[N, T]`` exponential or clip.
    """
    check_eps(eps_low, eps_high)
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    with torch.no_grad():
        log_ratio = masked_log_ratio(lp, old, mask)  # [N, T], 0 at padding
        log_seq = (log_ratio.sum(-1) / mask.sum(-1).clamp_min(1.0))[:, None]  # [N, 1] log s_i
        ratio = torch.exp(log_seq.clamp(max=log_ratio_max))  # [N, 1] s_i
        lower, upper = pessimistic_bounds(adv, lo, hi)  # [N, 1] (or [N, T])
        value = (-adv * ratio.clamp(lower, upper)) * mask  # −A·clip(s_i): PPO's min
        inside = (log_seq <= log_ratio_max) & (ratio >= lower) & (ratio <= upper)
        slope = -adv * ratio * inside  # ∂ℓ/∂logp_t = −A·s_i where nothing clips
        values = ratio_stats(ratio, adv, mask, lo, hi, log_ratio) if stats else None
    if slope.shape[-1] == 1:
        per_token = linearized(logp, value, slope, mask)
    else:
        per_token = linearized(logp, value, slope * mask)
    return per_token, ({} if values is None else to_floats(values))


def gspo_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    log_ratio_max: float = 10.0,
) -> torch.Tensor:
    """:func:`gspo` in plain autograd, the GSPO-token form: ``s_it = sg(s_i)·exp(logp_t −
    sg(logp_t))`` with ``log s_i`` the mean log-ratio (capped at ``log_ratio_max``), then PPO's
    ``max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high))``."""
    check_eps(eps_low, eps_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    log_s = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
    s = torch.exp((log_s.detach() + lp - lp.detach()).clamp(max=log_ratio_max))  # [N, T]
    loss = torch.maximum(-a * s, -a * s.clamp(1.0 - eps_low, 1.0 + eps_high))
    return autograd_masked(loss, m)


def reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: ``ℓ = −A·logp`` (on-policy policy gradient, Williams 1992).

    No importance weight and no clip: correct only when ``logp`` is evaluated at the policy
    that sampled the tokens (one update per batch). Ratio stats are still reported from
    ``old_logp`` so that off-policy drift is visible; clip fractions are 0.
    """
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    with torch.no_grad():
        value = torch.mul(lp, -adv).mul_(mask)  # −A·logp, 0 at padding
        slope = -adv if adv.shape[-1] == 1 else -adv * mask
        values = None
        if stats:
            log_ratio = masked_log_ratio(lp, old, mask)  # the ratio goes into its buffer
            values = ratio_stats(
                None, adv, mask, None, None, log_ratio, padding=1.0, scratch=log_ratio
            )
    per_token = linearized(logp, value, slope, mask if slope.shape[-1] == 1 else None)
    return per_token, ({} if values is None else to_floats(values))


def reinforce_autograd(
    logp: torch.Tensor, old_logp: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """:func:`reinforce` in plain autograd: ``−A·logp``."""
    lp, _, a, m = autograd_inputs(logp, old_logp, adv, mask)
    return autograd_masked(-a * lp, m)


SurrogateFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

SURROGATES: dict[str, SurrogateFn] = {
    "ppo_clip": ppo_clip,
    "cispo": cispo,
    "gspo": gspo,
    "reinforce": reinforce,
    "sapo": sapo,
    "gmpo": gmpo,
    "vespo": vespo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "dro": dro,
    "topr": topr,
}
"""Surrogate name -> function ``(logp, old_logp, adv, mask, *, stats=True, **params) ->
(per_token, stats)``."""

AUTOGRAD_FORMS: dict[str, Callable[..., torch.Tensor]] = {
    "ppo_clip": ppo_clip_autograd,
    "cispo": cispo_autograd,
    "gspo": gspo_autograd,
    "reinforce": reinforce_autograd,
    "sapo": sapo_autograd,
    "gmpo": gmpo_autograd,
    "vespo": vespo_autograd,
    "clip_cov": clip_cov_autograd,
    "kl_cov": kl_cov_autograd,
    "dppo_tv": dppo_tv_autograd,
    "dppo_kl": dppo_kl_autograd,
    "dro": dro_autograd,
    "topr": topr_autograd,
}
"""Surrogate name -> its plain autograd form ``(logp, old_logp, adv, mask, **params) ->
per_token [N, T]``: the formula as the papers and peers write it, with the same parameters
and defaults. :data:`SURROGATES` computes each value and its slope by hand
(``ratio.linearized``, for speed); ``tests/losses/test_autograd_forms.py`` holds every entry's
value and gradient equal to the fast form's."""


CLIPPED: frozenset[str] = frozenset(
    {"ppo_clip", "cispo", "gspo", "sapo", "gmpo", "vespo", "kl_cov", "dppo_tv", "dppo_kl", "dro"}
    | {"topr"}
)
"""Surrogates whose clip, gate, weight or penalty depends on ρ = π/π_old: it can only act once
the policy has moved, i.e. from the second optimizer step on the same generation batch; at
ρ ≡ 1 each is REINFORCE with its advantages (SAPO's gate has slope 1 at ρ = 1, VESPO's φ(1) = 1,
the KL-Cov and DRO penalties have zero gradient there, DPPO keeps every token). Clip-Cov is not
here: its covariance selection acts on-policy too."""


ZERO_AT_ZERO_ADVANTAGE: frozenset[str] = frozenset(SURROGATES) - {"kl_cov", "dro"}
"""Surrogates whose per-token loss (and gradient) is exactly 0 on a row with A = 0: every one
of the form −A·f(ρ) or −A·w·logp. KL-Cov's |log ρ| penalty and DRO's ½β(log ρ)² act on a row
whatever its advantage, so a trainer must not skip such rows (``train.loop.gradient_rows``)."""


def on_policy_warning(name: str, minibatches: int, ppo_epochs: int) -> str | None:
    """A warning when a clip-based surrogate runs one optimizer step per generation batch.

    With ``minibatches × ppo_epochs == 1`` the only optimizer step is taken at the behaviour
    policy, so ρ ≡ 1 at every token (up to float noise), every clip fraction is 0 and each
    surrogate of :data:`CLIPPED` reduces to REINFORCE with the preset's advantages and
    aggregation (ALGORITHMS.md §3 "Update schedule"). None when the schedule lets the clip act
    or the surrogate has no clip.
    """
    if name not in CLIPPED or minibatches * ppo_epochs > 1:
        return None
    return (
        f"surrogate {name!r} runs one optimizer step per generation batch (optim.minibatches="
        f"{minibatches}, optim.ppo_epochs={ppo_epochs}): every step sees ratio 1, so its clip "
        "never acts and the update is REINFORCE with these advantages. Set optim.minibatches or "
        "optim.ppo_epochs above 1 for the clip to act (DAPO and CISPO take 16 minibatches, GSPO "
        "4, AGPO 4 epochs)."
    )


def on_policy_note(name: str, preset: str, minibatches: int, ppo_epochs: int) -> str | None:
    """One line for a clip-based surrogate run at its preset's own one-step schedule.

    The same fact as :func:`on_policy_warning` (ρ ≡ 1, the clip never acts), but nothing to
    fix: the preset's sources take one update per generation batch (DeepSeekMath §4.2 for
    ``grpo``; ALGORITHMS.md §3 "Update schedule"), so it is said once, as a note [OURS: a warning at a preset's own schedule
    reads as "the default is broken"].
    None when the warning's condition does not hold.
    """
    if on_policy_warning(name, minibatches, ppo_epochs) is None:
        return None
    return (
        f"{preset} takes one optimizer step per generation batch, as its sources do: every "
        f"step is on-policy (ratio 1), so the {name} clip does not act"
    )


def surrogate(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    stats: bool = True,
    **params: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss ``[N, T]`` and stats of the surrogate called ``name`` (see SURROGATES).

    ``stats=False`` skips the statistics (an empty dict): the loss alone, as fast as it goes.
    """
    try:
        fn = SURROGATES[name]
    except KeyError:
        raise ValueError(
            f"unknown surrogate {name!r}; valid surrogates: {', '.join(SURROGATES)}"
        ) from None
    try:
        return fn(logp, old_logp, adv, mask, stats=stats, **params)
    except TypeError as err:
        if "unexpected keyword" in str(err):
            raise ValueError(f"surrogate {name!r}: {err}") from None
        raise
