"""How far the rollout engine's log-probs are from the trainer's (ALGORITHMS.md §5).

With ``log ρ_t = train_logp − rollout_logp`` over the valid completion tokens, computed
*before* any correction (TRL #5231 asks for the raw ratios; TRL logs only the truncated
ones), :func:`mismatch_metrics` returns flat ``mismatch/*`` floats:

- ``kl_k1``: mean of ``rollout − train`` (KL(π_rollout‖π_train), direct estimator; verl
  ``rollout_corr/kl``); ``kl_k3``: mean of ``ρ − 1 − log ρ`` (verl ``k3_kl``);
- ``chi2_token`` = E[ρ²] − 1, ``chi2_seq`` = E_seq[(Π_t ρ_t)²] − 1 (verl ``chi2_token`` /
  ``chi2_seq``; log ρ and its sequence sum clamped to ±20 as verl does);
- ``ppl_train``, ``ppl_rollout``: batch means of each sequence's perplexity;
  ``ppl_ratio`` = mean_i exp(mean_t log π_rollout − mean_t log π_train) (verl ``ppl_ratio``);
  ``log_ppl_abs_diff`` (verl);
- ``log_ppl_train``, ``log_ppl_rollout``: batch means of each sequence's −mean_t log π (verl
  ``training_log_ppl`` / ``rollout_log_ppl``); ``log_ppl_diff`` and its ``_max`` / ``_min``
  over the sequences: mean_t log π_rollout − mean_t log π_train (verl ``log_ppl_diff``,
  ``log_ppl_diff_max``, ``log_ppl_diff_min``; ``rollout_corr_helper.compute_offpolicy_metrics``);
- ``ess_token``, ``ess_seq``: effective sample size of the raw ratios as a share of the
  sample, ``(Σw)² / (n·Σw²)`` = 1 / mean((w / mean w)²) (verl's ``rollout_is_eff_sample_size``
  formula, applied before truncation);
- ``logp_diff_mean``, ``logp_diff_max``: mean / max of ``|train − rollout|`` (TRL
  ``sampling/sampling_logp_difference/{mean,max}``);
- ``ratio_min``, ``ratio_p01``, ``ratio_p50``, ``ratio_p99``, ``ratio_max``: token ratios
  before truncation; ``seq_log_ratio_p01`` / ``_p99``: quantiles of Σ_t log ρ_t;
- ``ratio_mean`` (token mean of ρ) and ``ratio_le1_frac`` (share of tokens with ρ ≤ 1)
  [OURS]: the **kept-mass bias** of an engine that renormalises its log-probs over the
  top-p / top-k tokens it kept (TRL #6789): there π_rollout = π/M on the kept tokens, M the
  kept mass, so ρ = M ≤ 1 at every token, ``ratio_le1_frac`` = 1 and ``ratio_mean`` is the
  mean kept mass (the health rule ``truncated_sampling`` reads these).

:func:`kept_mass_metrics` measures the same bias at the source, from the sampler itself:
the mass M of the kept set at every sampled token (``sampling/kept_mass_mean``,
``sampling/log_kept_mass_mean`` = the mean log ρ a full-softmax reading against renormalised
behaviour log-probs would carry).

Sequences without a valid token count in none of the sequence statistics [OURS: verl's
``chi2_seq`` averages over every row, an empty row adding (e^0)² = 1].
"""

from __future__ import annotations

import math

import torch

from grouprl.losses.correction import NAN_ROLLOUT, SAFETY_BOUND
from grouprl.types import to_floats

__all__ = [
    "MISMATCH_KEYS",
    "PEER_KEYS",
    "effective_sample_size",
    "from_peer_log",
    "kept_mass_metrics",
    "mismatch_metrics",
    "quantiles",
    "summarize",
]

QUANTILES = {"p01": 0.01, "p50": 0.5, "p99": 0.99}

MISMATCH_KEYS = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/ppl_train",
    "mismatch/ppl_rollout",
    "mismatch/ppl_ratio",
    "mismatch/log_ppl_abs_diff",
    "mismatch/log_ppl_train",
    "mismatch/log_ppl_rollout",
    "mismatch/log_ppl_diff",
    "mismatch/log_ppl_diff_max",
    "mismatch/log_ppl_diff_min",
    "mismatch/ess_token",
    "mismatch/ess_seq",
    "mismatch/logp_diff_mean",
    "mismatch/logp_diff_max",
    "mismatch/ratio_min",
    "mismatch/ratio_p01",
    "mismatch/ratio_p50",
    "mismatch/ratio_p99",
    "mismatch/ratio_max",
    "mismatch/ratio_mean",
    "mismatch/ratio_le1_frac",
    "mismatch/seq_log_ratio_p01",
    "mismatch/seq_log_ratio_p99",
)
"""Every key :func:`mismatch_metrics` returns."""


def quantiles(values: torch.Tensor, qs: dict[str, float]) -> dict[str, torch.Tensor]:
    """Linear-interpolation quantiles of a 1-D tensor (``torch.quantile``'s default rule,
    without its 16M-element limit): one sort."""
    v = values.reshape(-1).sort().values
    n = v.shape[0]
    out = {}
    for key, q in qs.items():
        if n == 0:
            out[key] = torch.zeros((), dtype=v.dtype, device=v.device)
            continue
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out[key] = v[lo] + (v[hi] - v[lo]) * (pos - lo)
    return out


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(Σ w)² / (n · Σ w²)`` over ``mask``'s entries: 1 for equal weights, 1/n for one.

    Equal to verl's ``1 / masked_mean((w / masked_mean(w))²)`` (``compute_is_metrics``, up to
    its 1e-8 guards); 0-dim tensor, 0 when nothing is valid or every weight is 0.
    """
    m = mask.to(weights.dtype)
    n = m.sum()
    s1 = (weights * m).sum()
    s2 = (weights.square() * m).sum()
    return torch.where(s2 > 0, s1.square() / (n * s2).clamp_min(1e-30), torch.zeros_like(s1))


@torch.no_grad()
def _row_extreme(x: torch.Tensor, rows: torch.Tensor, which) -> torch.Tensor:
    """Max (``which=max``) or min of ``x [N]`` over the rows with a valid token (0 if none)."""
    if not bool(rows.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[rows].amax() if which is max else x[rows].amin()


def mismatch_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    nan_rollout: str = "neutral",
) -> dict[str, float]:
    """The ``mismatch/*`` metrics of one batch (see the module docstring), as floats.

    ``train_logp``, ``rollout_logp``, ``mask``: ``[N, T]``. A NaN rollout log-prob (a token
    the engine could not score) is left out of every statistic with ``nan_rollout="neutral"``
    (TRL excludes such tokens from its logp-difference metrics) or raises with ``"error"``.
    """
    if nan_rollout not in NAN_ROLLOUT:
        raise ValueError(
            f"nan_rollout must be one of {', '.join(NAN_ROLLOUT)}, got {nan_rollout!r}"
        )
    for name, t in (("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.shape != train_logp.shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must have the shape of train_logp {tuple(train_logp.shape)}, got {got}"
            )
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    train, roll = train_logp.detach().to(dtype), rollout_logp.detach().to(dtype)
    valid = mask.bool()
    nan = torch.isnan(roll) & valid
    if nan_rollout == "error" and bool(nan.any()):
        raise ValueError(f"rollout_logp has {int(nan.sum())} NaN value(s) at valid tokens")
    valid = valid & ~nan
    bad = valid & ~(torch.isfinite(train) & torch.isfinite(roll))
    if bool(bad.any()):
        raise ValueError(
            f"train_logp / rollout_logp have {int(bad.sum())} infinite value(s) at valid tokens"
        )
    zero = torch.zeros((), dtype=dtype, device=train.device)
    train = torch.where(valid, train, zero)
    roll = torch.where(valid, roll, zero)
    m = valid.to(dtype)
    n_tok = m.sum().clamp_min(1.0)
    lengths = m.sum(-1)  # [N]
    rows = lengths > 0  # [N]
    n_seq = rows.to(dtype).sum().clamp_min(1.0)
    lr = train - roll  # [N, T] log ρ, 0 at padding
    lr_c = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(lr_c)
    seq_lr = lr.sum(-1)  # [N]
    mean_train = train.sum(-1) / lengths.clamp_min(1.0)  # [N]
    mean_roll = roll.sum(-1) / lengths.clamp_min(1.0)
    rowf = rows.to(dtype)
    log_ppl_diff = mean_roll - mean_train  # [N]
    seq_rho = torch.exp(seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [N]
    diff = lr.abs()
    out = {
        "kl_k1": (-lr * m).sum() / n_tok,
        "kl_k3": ((rho - 1.0 - lr_c) * m).sum() / n_tok,
        "chi2_token": (rho.square() * m).sum() / n_tok - 1.0,
        "chi2_seq": (seq_rho.square() * rowf).sum() / n_seq - 1.0,
        "ppl_train": (torch.exp(-mean_train) * rowf).sum() / n_seq,
        "ppl_rollout": (torch.exp(-mean_roll) * rowf).sum() / n_seq,
        "ppl_ratio": (torch.exp(log_ppl_diff) * rowf).sum() / n_seq,
        "log_ppl_abs_diff": (log_ppl_diff.abs() * rowf).sum() / n_seq,
        "log_ppl_train": (-mean_train * rowf).sum() / n_seq,
        "log_ppl_rollout": (-mean_roll * rowf).sum() / n_seq,
        "log_ppl_diff": (log_ppl_diff * rowf).sum() / n_seq,
        "log_ppl_diff_max": _row_extreme(log_ppl_diff, rows, max),
        "log_ppl_diff_min": _row_extreme(log_ppl_diff, rows, min),
        "ess_token": effective_sample_size(rho, valid),
        "ess_seq": effective_sample_size(seq_rho, rows),
        "logp_diff_mean": (diff * m).sum() / n_tok,
        "logp_diff_max": torch.where(valid, diff, zero).amax() if diff.numel() else zero,
    }
    tok = quantiles(rho[valid], {"min": 0.0, **QUANTILES, "max": 1.0})
    out.update({f"ratio_{k}": v for k, v in tok.items()})
    out["ratio_mean"] = (rho * m).sum() / n_tok
    out["ratio_le1_frac"] = ((lr <= 0) & valid).to(dtype).sum() / n_tok
    seq = quantiles(seq_lr[rows], {"p01": 0.01, "p99": 0.99})
    out.update({f"seq_log_ratio_{k}": v for k, v in seq.items()})
    return {f"mismatch/{k}": v for k, v in to_floats(out).items()}


@torch.no_grad()
def kept_mass_metrics(
    log_kept_mass: torch.Tensor | None, mask: torch.Tensor, kept_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """The sampler's kept mass over the valid tokens of a batch, ``sampling/*`` floats.

    ``log_kept_mass`` ``[N, T]``: log M at each sampled token (``Rollouts.log_kept_mass``;
    None: the sampler did not truncate, no metrics); ``mask`` ``[N, T]``; ``kept_ids``
    ``[N, T, K]`` (-1 padding) adds the mean size of the kept sets. ``kept_mass_mean`` is
    what ``mismatch/ratio_mean`` reads when an engine renormalises its log-probs over the kept
    tokens and the trainer scores the full softmax; ``log_kept_mass_mean`` its mean log ρ
    (= −``mismatch/kl_k1`` of that pair) [OURS].
    """
    if log_kept_mass is None:
        return {}
    valid = mask.bool()
    m = valid.to(torch.float32)
    n = m.sum().clamp_min(1.0)
    lm = torch.where(valid, log_kept_mass.float(), torch.zeros((), device=mask.device))
    out = {
        "kept_mass_mean": (lm.exp() * m).sum() / n,
        "log_kept_mass_mean": (lm * m).sum() / n,
        # log M <= 0 and padding holds 0, so the minimum over all entries is the valid one's
        "kept_mass_min": lm.amin().exp() if lm.numel() else torch.ones((), device=mask.device),
    }
    if kept_ids is not None:
        out["kept_tokens_mean"] = ((kept_ids >= 0).sum(-1).float() * m).sum() / n
    return {f"sampling/{k}": v for k, v in to_floats(out).items()}


# --------------------------------------------------------------------------- logged runs
PEER_KEYS: dict[str, dict[str, str]] = {
    "trl": {
        "sampling/sampling_logp_difference/mean": "mismatch/logp_diff_mean",
        "sampling/sampling_logp_difference/max": "mismatch/logp_diff_max",
        "sampling/importance_sampling_ratio/min": "corr/weight_min",
        "sampling/importance_sampling_ratio/mean": "corr/weight_mean",
        "sampling/importance_sampling_ratio/max": "corr/weight_max",
    },
    "verl": {
        "rollout_corr/kl": "mismatch/kl_k1",
        "rollout_corr/k3_kl": "mismatch/kl_k3",
        "rollout_corr/chi2_token": "mismatch/chi2_token",
        "rollout_corr/chi2_seq": "mismatch/chi2_seq",
        "rollout_corr/training_ppl": "mismatch/ppl_train",
        "rollout_corr/rollout_ppl": "mismatch/ppl_rollout",
        "rollout_corr/ppl_ratio": "mismatch/ppl_ratio",
        "rollout_corr/log_ppl_abs_diff": "mismatch/log_ppl_abs_diff",
        "rollout_corr/training_log_ppl": "mismatch/log_ppl_train",
        "rollout_corr/rollout_log_ppl": "mismatch/log_ppl_rollout",
        "rollout_corr/log_ppl_diff": "mismatch/log_ppl_diff",
        "rollout_corr/log_ppl_diff_max": "mismatch/log_ppl_diff_max",
        "rollout_corr/log_ppl_diff_min": "mismatch/log_ppl_diff_min",
        "rollout_corr/rollout_is_mean": "corr/weight_mean",
        "rollout_corr/rollout_is_min": "corr/weight_min",
        "rollout_corr/rollout_is_max": "corr/weight_max",
        "rollout_corr/rollout_is_eff_sample_size": "corr/ess",
        "rollout_corr/rollout_rs_masked_fraction": "corr/rejected_frac",
    },
}
"""Metric names TRL 1.16 (``GRPOTrainer``'s ``sampling/*``, truncated ratios) and verl 0.9.1
(``rollout_corr_helper``'s ``rollout_corr/*``) log -> ours. TRL runs through
:class:`grouprl.integrations.trl.GroupRLGRPOTrainer` also log ``grouprl/mismatch/*`` and
``grouprl/corr/*`` (ours, prefixed)."""


def from_peer_log(source: str, metrics: dict[str, float]) -> dict[str, float]:
    """One logged step of ``source`` (``"grouprl"``, ``"trl"``, ``"verl"``) in our key names:
    ``mismatch/*`` and ``corr/*`` only (empty when the step logged none)."""
    out: dict[str, float] = {}
    names = PEER_KEYS.get(source, {})
    for key, value in metrics.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        ours = names.get(key) or key.removeprefix("grouprl/")
        if ours.startswith(("mismatch/", "corr/")):
            out[ours] = float(value)
    return out


SUMMARY_KEYS = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/chi2_token",
    "mismatch/ppl_ratio",
    "mismatch/ess_token",
    "mismatch/logp_diff_mean",
    "mismatch/logp_diff_max",
    "mismatch/ratio_p01",
    "mismatch/ratio_p99",
    "mismatch/ratio_max",
    "mismatch/ratio_mean",
    "mismatch/ratio_le1_frac",
    "corr/weight_mean",
    "corr/weight_max",
    "corr/zeroed_frac",
    "corr/rejected_frac",
)


def summarize(rows: list[dict[str, float]]) -> list[dict[str, object]]:
    """``[{quantity, steps, first, last, max}]`` over the logged steps, for the keys of
    :data:`SUMMARY_KEYS` that at least one step holds (rows already in our key names)."""
    out: list[dict[str, object]] = []
    for key in SUMMARY_KEYS:
        vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        if vals:
            row = {"quantity": key, "steps": len(vals), "first": vals[0], "last": vals[-1]}
            out.append({**row, "max": max(vals)})
    return out
