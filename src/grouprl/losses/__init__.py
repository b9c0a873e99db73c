"""Losses, split into independent axes (ALGORITHMS.md §3): surrogate × aggregation × KL.

Token tensors are ``[N, T]`` (N = P·G sequences, prompt-major), advantages ``[N]``::

    from grouprl import losses
    per_token, stats = losses.surrogate("ppo_clip", logp, old_logp, adv, mask,
                                        eps_low=0.2, eps_high=0.28)
    loss = losses.aggregate("token_mean", per_token, mask)        # or with StepTotals
    kl = losses.kl("k3", logp, ref_logp)                           # per token
    out = losses.objective(logp, old_logp, adv, mask, surrogate="cispo", beta=0.04,
                           ref_logp=ref_logp, kl_weight=w, keep=keep, totals=totals)
    out.loss.backward()

Rollout correction (rollout engine vs trainer log-probs, :mod:`grouprl.losses.correction`)::

    corr = losses.correction.compute("icepop", old_logp, rollout_logp, mask)
    out = losses.objective(..., correction_weight=corr.weight, correction_keep=corr.keep,
                           totals=losses.step_totals(corr.loss_mask(mask)))

Registries: ``SURROGATES``, ``AGGREGATIONS``, ``KL_ESTIMATORS`` (+ verl's ``KL_ALIASES`` and
``+`` names), ``CORRECTIONS``. The batch filters (DAPO's
dynamic sampling and overlong handling) act on rollouts, not on the loss: they live next to
batch construction in :mod:`grouprl.train.filters`.
"""

from grouprl.losses import correction
from grouprl.losses.aggregation import (
    AGGREGATIONS,
    EXACT_UNDER_ACCUMULATION,
    StepTotals,
    aggregate,
    entropy_threshold,
    micro_token_mean,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    step_totals,
    token_mean,
    token_sum,
)
from grouprl.losses.correction import CORRECTIONS, Correction
from grouprl.losses.covariance import clip_cov_select, kl_cov_select
from grouprl.losses.kl import (
    KL_ALIASES,
    KL_CORRECTIONS,
    KL_ESTIMATORS,
    KL_VARIANTS,
    k1,
    k2,
    k3,
    kl,
    kl_autograd,
    kl_corrected,
    kl_corrected_autograd,
    kl_names,
    token_entropy,
)
from grouprl.losses.objective import Objective, objective
from grouprl.losses.sample_weights import sample_weights
from grouprl.losses.surrogates import (
    AUTOGRAD_FORMS,
    CLIPPED,
    SURROGATES,
    ZERO_AT_ZERO_ADVANTAGE,
    cispo,
    clip_cov,
    dppo_kl,
    dppo_tv,
    dro,
    gmpo,
    gspo,
    kl_cov,
    on_policy_note,
    on_policy_warning,
    ppo_clip,
    reinforce,
    sapo,
    surrogate,
    topr,
    vespo,
)

__all__ = [
    "AGGREGATIONS",
    "AUTOGRAD_FORMS",
    "CLIPPED",
    "CORRECTIONS",
    "EXACT_UNDER_ACCUMULATION",
    "KL_ALIASES",
    "KL_CORRECTIONS",
    "KL_ESTIMATORS",
    "KL_VARIANTS",
    "SURROGATES",
    "ZERO_AT_ZERO_ADVANTAGE",
    "Correction",
    "Objective",
    "StepTotals",
    "aggregate",
    "cispo",
    "clip_cov",
    "clip_cov_select",
    "correction",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "entropy_threshold",
    "gmpo",
    "gspo",
    "k1",
    "k2",
    "k3",
    "kl",
    "kl_autograd",
    "kl_corrected",
    "kl_corrected_autograd",
    "kl_cov",
    "kl_cov_select",
    "kl_names",
    "micro_token_mean",
    "objective",
    "on_policy_note",
    "on_policy_warning",
    "ppo_clip",
    "reinforce",
    "sample_weights",
    "sapo",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "step_totals",
    "surrogate",
    "token_entropy",
    "token_mean",
    "token_sum",
    "topr",
    "vespo",
]
