"""Rollout correction: weights and rejection masks for rollouts sampled by another engine.

A rollout engine (vLLM / SGLang in bf16, or our own generator at a lower precision) and the
trainer (FSDP in fp32) give the same sampled tokens different log-probabilities, so an
"on-policy" update is not (ALGORITHMS.md §3c). With the trainer's log-probs ``train_logp``
and the engine's ``rollout_logp`` of the same tokens, ``log ρ_t = train_logp − rollout_logp``
(ρ = π_train / π_rollout) and every method here maps ``log ρ [N, T]`` to

- ``weight [N, T]``: a detached factor on the surrogate's per-token loss (0 at padding); a
  zero weight leaves the token in the aggregation's normaliser (TRL's ``*_mask`` modes,
  verl's IcePop, DeepSeek-V3.2's sequence mask);
- ``keep [N, T]`` (bool): False *rejects* the token: it leaves every branch of the loss and
  every normaliser (verl's ``rollout_rs``, which rewrites ``response_mask``).

:func:`compute` validates the inputs once, runs one method or a chain of them (weights
multiply, ``keep`` masks AND) on the whole batch and returns a :class:`Correction`; pass its
rows to :func:`grouprl.losses.objective` (``correction_weight`` / ``correction_keep``) and
build the step's :class:`~grouprl.losses.StepTotals` from ``correction.loss_mask(mask)``, so
that batch quantities (a batch-normalised weight, the rejected-token counts) are computed
once per step and the micro-batch losses still add up to the one-batch loss::

    corr = losses.correction.compute("icepop", old_logp, rollout_logp, mask)
    totals = losses.step_totals(corr.loss_mask(mask))
    out = losses.objective(logp, old_logp, adv, mask, totals=totals,
                           correction_weight=corr.weight, correction_keep=corr.keep)

Registry: :data:`CORRECTIONS` (method name -> function). Each function has the signature
``f(log_ratio [N, T], mask [N, T] bool, adv [N] | None, **params) -> Parts`` and is pure;
``|log ρ|`` (or the sequence sum) is clamped to :data:`SAFETY_BOUND` before ``exp`` as verl
does. Specs for configs and the command line: :func:`parse_spec` (``"icepop"``,
``"seq_tis:cap=2"``, ``"seq_tis:cap=2+geo_rs"``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from grouprl.losses.divergence_rs import binary_kl_rejection
from grouprl.types import to_floats

__all__ = [
    "CORRECTIONS",
    "LOGP_INPUTS",
    "NAN_ROLLOUT",
    "SAFETY_BOUND",
    "USES_CURRENT_POLICY",
    "Correction",
    "Parts",
    "check_spec",
    "compute",
    "format_spec",
    "geo_rs",
    "icepop",
    "opsm",
    "parse_spec",
    "rejection",
    "seq_mis",
    "seq_tis",
    "token_mis",
    "token_tis",
    "trl_mode",
]

SAFETY_BOUND = 20.0
"""``log ρ`` (token) and ``Σ_t log ρ_t`` (sequence) are clamped to ±20 before ``exp``
(verl ``rollout_corr_helper.SAFETY_BOUND``); TRL does not clamp, which differs only when a
ratio passes e^20 ≈ 4.9e8 with no upper cap."""

NAN_ROLLOUT = ("error", "neutral")
"""What a NaN rollout log-prob at a valid token means: ``"error"`` (default, a ValueError) or
``"neutral"`` (TRL 1.16 ``_generate_and_score_completions``: vLLM could not score the token,
its log-ratio counts as 0, i.e. ρ = 1, in every method)."""

Spec = str | tuple[str, Mapping[str, Any]] | Sequence[str | tuple[str, Mapping[str, Any]]]


class Parts(NamedTuple):
    """What one method returns: ``weight [N, T]``, ``keep [N, T]`` bool, ``stats`` (0-dim)."""

    weight: torch.Tensor
    keep: torch.Tensor
    stats: dict[str, torch.Tensor]


# --------------------------------------------------------------------------- helpers
def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``m``'s True entries (0 when there is none)."""
    mf = m.to(x.dtype)
    return (x * mf).sum() / mf.sum().clamp_min(1.0)


def _seq_stat(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``[N, T] -> [N]``: sum / mean / max of ``x`` over each row's valid tokens (0 if none)."""
    m = mask.to(x.dtype)
    if how == "sum":
        return (x * m).sum(-1)
    if how == "mean":
        return (x * m).sum(-1) / m.sum(-1).clamp_min(1.0)
    neg = torch.full_like(x, -math.inf)
    top = torch.where(mask, x, neg).amax(-1)  # [N]
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def _exp(log_x: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_x.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def _check_bounds(method: str, cap: float | None, cap_low: float | None, need_one: bool) -> None:
    """An upper cap must be >= 1 and a lower one in [0, 1]: on-policy (ρ = 1) must pass."""
    if cap is not None and not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(
            f"{method}: the upper cap must be a finite number >= 1 (an on-policy token has "
            f"ratio 1), got cap={cap}; TIS uses 2 (verl), TRL 3, IcePop 5"
        )
    if cap_low is not None and not (math.isfinite(cap_low) and 0.0 <= cap_low <= 1.0):
        raise ValueError(
            f"{method}: the lower bound must be in [0, 1] (an on-policy token has ratio 1), "
            f"got cap_low={cap_low}; IcePop uses 0.5"
        )
    if need_one and cap is None and cap_low is None:
        raise ValueError(f"{method}: give cap, cap_low or both (TRL requires one of them)")


def _batch_normalize(
    w: torch.Tensor, mask: torch.Tensor, sequence: bool, stats: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Divide by the batch mean weight (verl ``rollout_is_batch_normalize``).

    Token level: the mean over valid tokens; sequence level: the mean over sequences with a
    valid token of each sequence's weight. No division when the mean is <= 1e-8 (verl).
    """
    if sequence:
        mean = _masked_mean(_seq_stat(w, mask, "mean"), mask.any(-1))
    else:
        mean = _masked_mean(w, mask)
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    stats["batch_norm_factor"] = factor
    return w / factor


def _weight_stats(
    w: torch.Tensor, mask: torch.Tensor, sequence: bool, stats: dict[str, torch.Tensor]
) -> None:
    """Applied-weight statistics: over valid tokens, or over sequences at sequence level
    (TRL's ``sampling/importance_sampling_ratio/{min,mean,max}``)."""
    if sequence:
        vals, sel = _seq_stat(w, mask, "mean"), mask.any(-1)  # [N]
    else:
        vals, sel = w, mask
    inf = torch.tensor(math.inf, dtype=w.dtype, device=w.device)
    lo, hi = torch.where(sel, vals, inf).amin(), torch.where(sel, vals, -inf).amax()
    stats["weight_mean"] = _masked_mean(vals, sel)
    stats["weight_min"] = torch.where(torch.isinf(lo), torch.zeros_like(lo), lo)  # 0 if empty
    stats["weight_max"] = torch.where(torch.isinf(hi), torch.zeros_like(hi), hi)


def _ratio_weight(
    method: str,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sequence: bool,
    truncate: bool,
    cap: float | None,
    cap_low: float | None,
    batch_normalize: bool,
) -> Parts:
    """Token or sequence importance weight, truncated (TIS) or masked (MIS / IcePop)."""
    _check_bounds(method, cap, cap_low, need_one=truncate)
    mf = mask.to(log_ratio.dtype)
    if sequence:
        ratio = _exp(_seq_stat(log_ratio, mask, "sum"))[:, None].expand_as(log_ratio)  # [N, T]
    else:
        ratio = _exp(log_ratio)  # [N, T]
    lo = -math.inf if cap_low is None else cap_low
    hi = math.inf if cap is None else cap
    outside = (ratio < lo) | (ratio > hi)  # [N, T]
    stats: dict[str, torch.Tensor] = {}
    if truncate:
        w = ratio.clamp(min=cap_low, max=cap)
        stats["truncated_frac"] = _unit_frac(outside, mask, sequence)
    else:
        w = torch.where(outside, torch.zeros_like(ratio), ratio)
        stats["zeroed_frac"] = _unit_frac(outside, mask, sequence)
    w = w * mf
    if batch_normalize:
        w = _batch_normalize(w, mask, sequence, stats)
    _weight_stats(w, mask, sequence, stats)
    return Parts(w, mask.clone(), stats)


def _unit_frac(flag: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    """Share of valid tokens (or of sequences with a valid token) where ``flag`` holds
    (``flag`` is constant along a row at sequence level)."""
    if sequence:
        return _masked_mean(flag.any(-1).to(torch.float32), mask.any(-1))
    return _masked_mean(flag.to(torch.float32), mask)


# --------------------------------------------------------------------------- the methods
def token_tis(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    cap: float | None = 2.0,
    cap_low: float | None = None,
    batch_normalize: bool = False,
) -> Parts:
    """Token-level truncated IS: ``w_t = clip(ρ_t, cap_low, cap)``.

    Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
    training"): ``min(ρ_t, C)``, C = 2 (verl ``rollout_is="token"``, threshold 2.0). TRL's
    ``vllm_importance_sampling_mode="token_truncate"`` also clips from below at
    ``vllm_importance_sampling_clip_min`` (``cap_low``); OpenRLHF's token ``clip`` mode clips
    at both ends. ``batch_normalize``: divide by the batch mean weight (verl).
    Stats: ``truncated_frac`` (valid tokens outside [cap_low, cap]), ``weight_*``.
    """
    return _ratio_weight("token_tis", log_ratio, mask, False, True, cap, cap_low, batch_normalize)


def seq_tis(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    cap: float | None = 2.0,
    cap_low: float | None = None,
    batch_normalize: bool = False,
) -> Parts:
    """Sequence-level truncated IS: ``w_i = clip(Π_t ρ_t, cap_low, cap)`` on every token of i.

    verl ``rollout_is="sequence"`` (threshold 2.0; Σ log ρ clamped to ±20 first); TRL
    ``"sequence_truncate"`` with ``clip_min`` / ``clip_max``. Unbiased before truncation,
    high variance on long sequences. Stats per sequence: ``truncated_frac``, ``weight_*``.
    """
    return _ratio_weight("seq_tis", log_ratio, mask, True, True, cap, cap_low, batch_normalize)


def token_mis(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    cap: float | None = 3.0,
    cap_low: float | None = None,
    batch_normalize: bool = False,
) -> Parts:
    """Token-level masked IS: ``w_t = ρ_t`` inside [cap_low, cap], 0 outside.

    TRL ``vllm_importance_sampling_mode="token_mask"`` (``clip_max`` default 3.0, ``clip_min``
    default none); a zeroed token stays in the normaliser. With cap_low = 0.5, cap = 5 this is
    :func:`icepop`. Stats: ``zeroed_frac``, ``weight_*``.
    """
    return _ratio_weight("token_mis", log_ratio, mask, False, False, cap, cap_low, batch_normalize)


def seq_mis(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    cap: float | None = 3.0,
    cap_low: float | None = None,
    batch_normalize: bool = False,
) -> Parts:
    """Sequence-level masked IS: ``w_i = Π_t ρ_t`` inside [cap_low, cap], else 0 (TRL default).

    Liu et al. 2025 ("When speed kills stability"): sequences whose ratio passes C get no
    gradient. TRL ``"sequence_mask"`` (its default mode, ``clip_max`` 3.0): the zeroed
    sequence stays in the normaliser. verl's "Seq-MIS" preset (``decoupled_seq_is_rs``) is
    the other reading: :func:`seq_tis` plus :func:`rejection` on ``seq_sum`` k1, which
    *removes* the rejected sequences from the normaliser (ALGORITHMS.md §3c).
    """
    return _ratio_weight("seq_mis", log_ratio, mask, True, False, cap, cap_low, batch_normalize)


def icepop(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    low: float = 0.5,
    high: float = 5.0,
    batch_normalize: bool = False,
) -> Parts:
    """IcePop's two-sided token mask: ``w_t = ρ_t·1[low ≤ ρ_t ≤ high]``.

    Ring-1T (Ling Team 2025, IcePop): tokens whose train/inference ratio leaves [α, β] are
    excluded from the gradient, the others keep their ratio; α = 0.5, β = 5 (verl
    ``decoupled_token_icepop``: ``rollout_is="token"``, threshold ``"0.5_5.0"``, weights
    zeroed, ``response_mask`` unchanged; OpenRLHF token ``mask`` mode). Stats: ``zeroed_frac``.
    """
    return _ratio_weight("icepop", log_ratio, mask, False, False, high, low, batch_normalize)


STATS = ("k1", "k2", "k3")
LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
K1_BOUNDS = ("ratio", "inverse_ratio")


def _k1_bounds(method: str, threshold: float | None, low: float | None) -> tuple[float, float]:
    if threshold is None or not (math.isfinite(threshold) and threshold >= 1.0):
        raise ValueError(
            f"{method}: k1 needs threshold >= 1, the upper bound on the ratio (verl "
            f"rollout_rs_threshold, e.g. 2.0 or 1.001), got threshold={threshold}"
        )
    lo = 1.0 / threshold if low is None else low
    if not (math.isfinite(lo) and 0.0 < lo <= 1.0):
        raise ValueError(f"{method}: k1's lower ratio bound must be in (0, 1], got low={low}")
    return lo, threshold


def rejection(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    stat: str = "k3",
    level: str = "seq_mean",
    threshold: float | None = None,
    low: float | None = None,
    k1_bounds_on: str = "ratio",
) -> Parts:
    """Rejection sampling on a divergence: tokens / sequences past a threshold leave the loss.

    verl ``rollout_rs`` (``rollout_corr_helper.compute_rollout_rejection_mask``): with
    ``lr = clamp(log ρ, ±20)``, the per-token statistics are k1 = ``lr`` (a log-ratio),
    k2 = ``½ lr²``, k3 = ``e^lr − 1 − lr`` (KL(π_rollout‖π_train) estimators). ``level``:
    ``token`` (each token alone), ``seq_sum`` / ``seq_mean`` / ``seq_max`` (one value per
    sequence; ``seq_max`` only for k2 / k3). k2 / k3 reject above ``threshold``; k1 keeps
    ``low ≤ exp(stat) ≤ threshold`` (``low`` defaults to 1 / threshold).

    ``k1_bounds_on``: verl 0.9.1's documentation calls the k1 bounds ratio bounds
    (``"ratio"``, our default), but its code compares ``−log ρ`` with ``[log low, log high]``,
    i.e. bounds ``1/ρ`` (``"inverse_ratio"``); the two agree for symmetric bounds
    (low = 1/high) and differ otherwise [OURS: default to the documented reading].

    Rejected tokens get ``keep = False`` (they leave every branch and normaliser, as verl
    rewrites ``response_mask``). Stats: ``rejected_frac`` (valid tokens), ``rejected_seq_frac``
    (sequences with a valid token that lost at least one).
    """
    method = f"rejection({stat}, {level})"
    if stat not in STATS:
        raise ValueError(f"rejection: unknown stat {stat!r}; valid: {', '.join(STATS)}")
    if level not in LEVELS:
        raise ValueError(f"rejection: unknown level {level!r}; valid: {', '.join(LEVELS)}")
    if k1_bounds_on not in K1_BOUNDS:
        raise ValueError(
            f"rejection: k1_bounds_on must be one of {', '.join(K1_BOUNDS)}, got {k1_bounds_on!r}"
        )
    if level == "seq_max" and stat == "k1":
        raise ValueError("rejection: seq_max takes k2 or k3 (as verl); k1 has two bounds")
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}[stat]
    if level == "token":
        value = per_token  # [N, T]
    else:
        value = _seq_stat(per_token, mask, level.removeprefix("seq_"))[:, None]  # [N, 1]
    if stat == "k1":
        lo, hi = _k1_bounds(method, threshold, low)
        v = value if k1_bounds_on == "ratio" else -value
        ok = (v >= math.log(lo)) & (v <= math.log(hi))
    else:
        if low is not None:
            raise ValueError(f"{method}: k2 / k3 take an upper threshold only, got low={low}")
        if threshold is None or not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(
                f"{method}: needs threshold > 0, the largest divergence kept (verl's "
                f"bypass_ppo_clip_k3_rs uses 0.01), got threshold={threshold}"
            )
        ok = value <= threshold
    keep = ok.expand_as(mask) & mask
    rejected = mask & ~keep
    rows = mask.any(-1)
    stats = {
        "rejected_frac": _masked_mean(rejected.to(torch.float32), mask),
        "rejected_seq_frac": _masked_mean(rejected.any(-1).to(torch.float32), rows),
    }
    return Parts(mask.to(log_ratio.dtype), keep, stats)


def geo_rs(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    low: float = 0.999,
    high: float = 1.001,
    k1_bounds_on: str = "ratio",
) -> Parts:
    """Geometric-mean rejection: drop a sequence whose ``exp(mean_t log ρ_t)`` leaves [low, high].

    The length-normalised sequence ratio (verl ``decoupled_geo_rs``: ``rollout_rs=
    "seq_mean_k1"``, threshold ``"0.999_1.001"``; OpenRLHF ``is_correction_level="seq"`` with
    ratio gating). :func:`rejection` with ``stat="k1", level="seq_mean"``.
    """
    return rejection(
        log_ratio,
        mask,
        adv,
        stat="k1",
        level="seq_mean",
        threshold=high,
        low=low,
        k1_bounds_on=k1_bounds_on,
    )


def opsm(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor | None = None,
    *,
    threshold: float | None = None,
) -> Parts:
    """DeepSeek-V3.2's off-policy sequence mask: drop negative-advantage sequences that drifted.

    DeepSeek-V3.2 (arXiv 2512.02556) §3.1, Eq. 9: a sequence with ``A_i < 0`` and
    ``(1/|o_i|) Σ_t log(π_rollout / π_θ) > δ`` gets weight 0 (kept in the normaliser: TRL
    ``GRPOTrainer.get_off_policy_mask`` multiplies the per-token loss by it). ``log_ratio``
    must be the *current* policy against the rollout (TRL uses ``per_token_logps.detach()``
    per micro-batch), so the mask is computed where the loss is, not once per batch
    (:data:`USES_CURRENT_POLICY`). ``threshold`` = δ (TRL ``off_policy_mask_threshold``; no
    default, TRL suggests 0.5). Stats: ``zeroed_frac`` (sequences), ``drift_mean``.
    """
    if threshold is None or not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(
            "opsm: needs threshold >= 0, DeepSeek-V3.2's delta on the mean per-token log "
            f"ratio rollout/current (TRL off_policy_mask_threshold, e.g. 0.5), got {threshold}"
        )
    if adv is None:
        raise ValueError("opsm: needs the advantages adv [N] (it drops A < 0 sequences only)")
    drift = -_seq_stat(log_ratio, mask, "mean")  # [N] mean log(π_rollout / π_θ)
    keep_row = (adv.reshape(-1) >= 0) | (drift <= threshold)  # [N]
    w = keep_row[:, None].to(log_ratio.dtype) * mask.to(log_ratio.dtype)
    rows = mask.any(-1)
    stats = {
        "zeroed_frac": _masked_mean((~keep_row).to(torch.float32), rows),
        "drift_mean": _masked_mean(drift, rows),
    }
    return Parts(w, mask.clone(), stats)


CorrectionFn = Callable[..., Parts]

CORRECTIONS: dict[str, CorrectionFn] = {
    "token_tis": token_tis,
    "seq_tis": seq_tis,
    "token_mis": token_mis,
    "seq_mis": seq_mis,
    "icepop": icepop,
    "rejection": rejection,
    "geo_rs": geo_rs,
    "opsm": opsm,
    "binary_kl": binary_kl_rejection,
}
"""Correction name -> ``f(log_ratio [N, T], mask [N, T] bool, adv [N] | None, **params)``."""

LOGP_INPUTS = ("train_logp", "rollout_logp")
"""Keyword inputs a method may declare to receive the validated log-probabilities themselves
(``[N, T]``, 0 at padding; a NaN-neutral rollout token holds the trainer's value, ρ = 1);
they are inputs, not parameters of the spec."""

USES_CURRENT_POLICY: frozenset[str] = frozenset({"opsm"})
"""Methods whose log-ratio is the current policy against the rollout (computed per
micro-batch inside the loss); the others use the trainer's log-probs at the behaviour
parameters and are computed once per batch (verl's decoupled mode)."""


# --------------------------------------------------------------------------- TRL's modes
TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_mode(
    mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0
) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` that compute TRL's ``vllm_importance_sampling_mode`` with its caps.

    TRL 1.16 ``GRPOConfig``: ``vllm_importance_sampling_mode`` (default ``"sequence_mask"``),
    ``vllm_importance_sampling_clip_min`` (default None), ``..._clip_max`` (default 3.0).
    """
    names = {
        "token_truncate": "token_tis",
        "token_mask": "token_mis",
        "sequence_truncate": "seq_tis",
        "sequence_mask": "seq_mis",
    }
    if mode not in names:
        raise ValueError(
            f"unknown vllm_importance_sampling_mode {mode!r}; valid: {', '.join(TRL_MODES)}"
        )
    return names[mode], {"cap": clip_max, "cap_low": clip_min}


# --------------------------------------------------------------------------- specs
def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(text) if any(c in low for c in ".e") or low in ("inf", "nan") else int(text)
    except ValueError:
        return text.strip()


def parse_spec(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``"name[:key=value,...][+name...]"`` -> ``[(name, params), ...]`` (validated names).

    ``"icepop"``, ``"seq_tis:cap=2"``, ``"seq_tis:cap=2+rejection:stat=k1,level=seq_sum,
    threshold=2"``; ``"none"`` or ``""`` -> ``[]`` (no correction).
    """
    if not isinstance(text, str):
        raise ValueError(f"a correction spec must be a string, got {type(text).__name__}")
    if text.strip().lower() in ("", "none", "off"):
        return []
    out: list[tuple[str, dict[str, Any]]] = []
    for part in text.split("+"):
        name, _, rest = part.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(
                    f"rollout correction {part.strip()!r}: parameters are key=value, got {item!r}"
                )
            params[key.strip()] = _parse_value(value)
        _check_method(name.strip(), params)
        out.append((name.strip(), params))
    return out


def check_spec(text: str) -> list[tuple[str, dict[str, Any]]]:
    """:func:`parse_spec` plus a dry run of every method on one token, so that a bad value
    (a cap below 1, a missing threshold) is a ValueError when a config loads, not at a step."""
    spec = parse_spec(text)
    one = torch.zeros(1, 1)
    compute(spec, one, one, torch.ones(1, 1), adv=torch.zeros(1))
    return spec


def format_spec(spec: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The string :func:`parse_spec` reads back into ``spec`` (``"none"`` when empty)."""
    if not spec:
        return "none"
    parts = []
    for name, params in spec:
        items = ",".join(f"{k}={v}" for k, v in params.items())
        parts.append(f"{name}:{items}" if items else name)
    return "+".join(parts)


def _check_method(name: str, params: Mapping[str, Any]) -> CorrectionFn:
    try:
        fn = CORRECTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout correction {name!r}; valid corrections: {', '.join(CORRECTIONS)}"
        ) from None
    fixed = ("log_ratio", "mask", "adv", *LOGP_INPUTS)
    allowed = [p for p in inspect.signature(fn).parameters if p not in fixed]
    bad = [k for k in params if k not in allowed]
    if bad:
        raise ValueError(
            f"rollout correction {name!r} has no parameter {', '.join(bad)}; its parameters: "
            f"{', '.join(allowed)}"
        )
    return fn


def _normalise_spec(spec: Spec) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(spec, str):
        return parse_spec(spec)
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and isinstance(spec[1], Mapping)
    ):
        return [(spec[0], dict(spec[1]))]
    out: list[tuple[str, dict[str, Any]]] = []
    for item in spec:
        out += _normalise_spec(item)
    return out


# --------------------------------------------------------------------------- compute
@dataclass(frozen=True)
class Correction:
    """The result of :func:`compute` on one batch.

    Attributes:
        weight: ``[N, T]`` float32, detached, >= 0, 0 at padding: multiplies the surrogate's
            per-token loss (``objective(correction_weight=...)``).
        keep: ``[N, T]`` bool: False = rejected, out of every branch and normaliser
            (``objective(correction_keep=...)``; build the totals from :meth:`loss_mask`).
        stats: floats: ``corr/<method>/<stat>`` of every method in the chain, and over the
            chain ``corr/weight_mean`` (valid, kept tokens), ``corr/zeroed_frac`` (valid kept
            tokens whose weight is 0) and ``corr/rejected_frac`` (valid tokens rejected).
        spec: the chain that produced it.
    """

    weight: torch.Tensor  # [N, T]
    keep: torch.Tensor  # [N, T] bool
    stats: dict[str, float] = field(default_factory=dict)
    spec: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    def loss_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask & keep`` as ``mask``'s dtype: the mask for :func:`grouprl.losses.step_totals`."""
        return (mask.bool() & self.keep).to(mask.dtype)

    def rows(self, index: Any) -> Correction:
        """The correction of a subset of rows (a micro-batch): ``index`` as for tensor indexing."""
        return Correction(self.weight[index], self.keep[index], self.stats, self.spec)


def _check_logp(
    train_logp: Any, rollout_logp: Any, mask: Any, nan_rollout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``(log_ratio [N, T] at least float32, 0 at padding and NaN-neutral tokens;
    valid [N, T] bool)``."""
    if nan_rollout not in NAN_ROLLOUT:
        raise ValueError(
            f"nan_rollout must be one of {', '.join(NAN_ROLLOUT)}, got {nan_rollout!r}"
        )
    if not isinstance(train_logp, torch.Tensor) or train_logp.dim() != 2:
        got = tuple(train_logp.shape) if isinstance(train_logp, torch.Tensor) else type(train_logp)
        raise ValueError(f"train_logp must be a [N, T] tensor, got {got}")
    for name, t in (("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.shape != train_logp.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must have the shape of train_logp {tuple(train_logp.shape)} (one value "
                f"per completion token), got {got}"
            )
    valid = mask.bool()
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    train = train_logp.detach().to(dtype)
    roll = rollout_logp.detach().to(dtype)
    bad_train = valid & ~torch.isfinite(train)
    if bool(bad_train.any()):
        raise ValueError(
            f"train_logp has {int(bad_train.sum())} non-finite value(s) at valid tokens; check "
            "the trainer's forward pass and the mask alignment"
        )
    nan = valid & torch.isnan(roll)
    bad_roll = valid & ~torch.isfinite(roll) & ~(nan if nan_rollout == "neutral" else False)
    if bool(bad_roll.any()):
        raise ValueError(
            f"rollout_logp has {int(bad_roll.sum())} non-finite value(s) at valid tokens; an "
            "engine that cannot score some tokens (vLLM returns None -> NaN) can pass "
            "nan_rollout='neutral' (TRL's rule: such a token has ratio 1)"
        )
    zero = torch.zeros((), dtype=dtype, device=train.device)
    log_ratio = torch.where(valid & ~nan, train - roll, zero)  # [N, T]
    return log_ratio, valid


def _logp_inputs(train_logp, log_ratio, valid) -> dict[str, torch.Tensor]:
    """``train_logp`` / ``rollout_logp`` for a method of :data:`LOGP_INPUTS`: 0 at padding,
    ``rollout = train − log ρ`` (so a NaN-neutral token, log ρ = 0, has the trainer's value)."""
    train = torch.where(valid, train_logp.detach().to(log_ratio.dtype), 0.0)
    return {"train_logp": train, "rollout_logp": torch.where(valid, train - log_ratio, 0.0)}


def compute(
    spec: Spec,
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    adv: torch.Tensor | None = None,
    nan_rollout: str = "error",
) -> Correction:
    """Run the correction ``spec`` on one batch: ``log ρ = train_logp − rollout_logp``.

    Args:
        spec: a method name, ``(name, params)``, a list of them (a chain: weights multiply,
            ``keep`` masks AND), or a :func:`parse_spec` string. An empty chain gives weight
            1 and keep = mask.
        train_logp, rollout_logp, mask: ``[N, T]``; padding may hold anything.
        adv: ``[N]`` advantages (only :func:`opsm` reads them).
        nan_rollout: see :data:`NAN_ROLLOUT`.

    Compute it once per batch on every row of the batch (a micro-batch takes
    ``correction.rows(...)``): a batch-normalised weight and the rejected-token counts are
    batch quantities.
    """
    chain = _normalise_spec(spec)
    log_ratio, valid = _check_logp(train_logp, rollout_logp, mask, nan_rollout)
    n = log_ratio.shape[0]
    if adv is not None and (not isinstance(adv, torch.Tensor) or adv.reshape(-1).shape != (n,)):
        raise ValueError(f"adv must be [N]={n}, one advantage per sequence")
    weight = valid.to(log_ratio.dtype)  # [N, T]
    keep = valid.clone()
    stats: dict[str, torch.Tensor] = {}
    for name, params in chain:
        fn = _check_method(name, params)
        inputs = {}
        if any(k in inspect.signature(fn).parameters for k in LOGP_INPUTS):
            inputs = _logp_inputs(train_logp, log_ratio, valid)
        parts = fn(log_ratio, valid, adv, **params, **inputs)
        weight = weight * parts.weight
        keep = keep & parts.keep
        stats.update({f"corr/{name}/{k}": v for k, v in parts.stats.items()})
    kept = keep & valid
    stats["corr/weight_mean"] = _masked_mean(weight, kept)
    stats["corr/zeroed_frac"] = _masked_mean((kept & (weight == 0)).to(torch.float32), valid)
    stats["corr/rejected_frac"] = _masked_mean((valid & ~keep).to(torch.float32), valid)
    frozen = tuple((name, tuple(sorted(params.items()))) for name, params in chain)
    return Correction(weight.detach(), keep, to_floats(stats), frozen)
