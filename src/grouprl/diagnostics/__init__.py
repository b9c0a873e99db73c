"""Training-health diagnostics: pure functions over batches, and rules that turn them into advice.

- :func:`acr`, :func:`collapse_split`: advantage-collapse rate and its split (ALGORITHMS.md §5);
- :func:`step_metrics`: the trainer's per-step metric dict (cheap, flat, namespaced);
- :class:`RunHealth` (``health``): cumulative ACR, ACR_100, stall alarm, divergence and tail
  rules, each warning with the recommended action;
- :func:`inverse_scale_tail`: P95/P99 of 1/scale over updated groups;
- :func:`reward_kl_balance`, :func:`kl_stats`: R/KL, direction cosine, KL mean / P95;
  :func:`low_sigma_groups`: MaxNorm Table 3's subset (updated groups with σ_q < 1e-2);
- :func:`tail_miss_probability`, :func:`p_active`, :func:`advise_group_size`: F-GRPO Lemma 3.1;
- :func:`sigma_stats`, :func:`gradient_orthogonality`: the normalisation regime;
- :func:`pass_at_k`: unbiased pass@k;
- :func:`mismatch_metrics`: rollout-engine vs trainer log-probs (KL, χ², perplexity ratio,
  effective sample size, raw ratio quantiles).
"""

from __future__ import annotations

from grouprl.diagnostics import health
from grouprl.diagnostics.acr import DEFAULT_TAU, acr, collapse_split
from grouprl.diagnostics.balance import (
    LOW_SIGMA,
    flat_gradient,
    gradient_balance,
    kl_stats,
    low_sigma_groups,
    reward_kl_balance,
    subset_keys,
)
from grouprl.diagnostics.health import HealthConfig, RunHealth
from grouprl.diagnostics.inverse_scale import inverse_scale_tail, updated_groups
from grouprl.diagnostics.metrics import STEP_METRIC_KEYS, shaping_metrics, step_metrics
from grouprl.diagnostics.mismatch import (
    MISMATCH_KEYS,
    effective_sample_size,
    kept_mass_metrics,
    mismatch_metrics,
)
from grouprl.diagnostics.passk import pass_at_k
from grouprl.diagnostics.regime import gradient_orthogonality, per_prompt_gradients, sigma_stats
from grouprl.diagnostics.tailmiss import (
    GroupSizeAdvice,
    advise_group_size,
    p_active,
    tail_miss_probability,
)

__all__ = [
    "DEFAULT_TAU",
    "LOW_SIGMA",
    "MISMATCH_KEYS",
    "STEP_METRIC_KEYS",
    "GroupSizeAdvice",
    "HealthConfig",
    "RunHealth",
    "acr",
    "advise_group_size",
    "collapse_split",
    "effective_sample_size",
    "flat_gradient",
    "gradient_balance",
    "gradient_orthogonality",
    "health",
    "inverse_scale_tail",
    "kept_mass_metrics",
    "kl_stats",
    "low_sigma_groups",
    "mismatch_metrics",
    "p_active",
    "pass_at_k",
    "per_prompt_gradients",
    "reward_kl_balance",
    "shaping_metrics",
    "sigma_stats",
    "step_metrics",
    "subset_keys",
    "tail_miss_probability",
    "updated_groups",
]
