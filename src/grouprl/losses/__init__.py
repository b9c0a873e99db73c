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

import inspect
from typing import Any

from grouprl import registry
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
    "register_aggregation",
    "register_correction",
    "register_kl",
    "register_surrogate",
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


# ---- the registration of each loss axis (grouprl.registry) -------------------------------------


def _accepted(fn: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``params`` that ``fn`` takes as keywords."""
    names = inspect.signature(fn).parameters
    return {k: v for k, v in params.items() if k in names}


def _clip_cov_step(logps, old_logps, advs, masks, **params):
    """Clip-Cov's selection over the step's micro-batches (lists), from its surrogate params."""
    return clip_cov_select(logps, old_logps, advs, masks, **_accepted(clip_cov_select, params))


def _kl_cov_step(logps, old_logps, advs, masks, **params):
    """KL-Cov's selection over the step's micro-batches (lists), from its surrogate params."""
    return kl_cov_select(logps, advs, masks, **_accepted(kl_cov_select, params))


surrogate_axis = registry.Axis(
    "surrogate",
    SURROGATES,
    positional=("logp", "old_logp", "adv", "mask"),
    inputs=("entropy", "step_selection"),
    skip=("stats", "selected", "generator", *registry.INPUTS),
    keywords={"step_selection": "selected"},
    example="(logp [N, T], old_logp [N, T], adv [N] | [N, T], mask [N, T], *, stats=True, "
    "**settings) -> (per_token [N, T], stats dict)",
)
"""The surrogate axis over :data:`SURROGATES`. Axis facts in each declaration's ``extra``:
``select`` (``reads={"step_selection"}``: ``select(logps, old_logps, advs, masks, **params)``
over the step's micro-batches, whose result comes back as ``selected=``),
``zero_at_zero_advantage`` (False: a row with A = 0 still has a gradient) and ``clipped``
(its clip acts only once ρ ≠ 1: the on-policy warning)."""
for _name in SURROGATES:
    surrogate_axis.declare(
        _name,
        zero_at_zero_advantage=_name in ZERO_AT_ZERO_ADVANTAGE,
        clipped=_name in CLIPPED,
    )
surrogate_axis.declare("clip_cov", reads={"step_selection"}, select=_clip_cov_step)
surrogate_axis.declare(
    "kl_cov", reads={"step_selection"}, select=_kl_cov_step, zero_at_zero_advantage=False
)


def register_surrogate(
    name: str,
    fn: Any = None,
    *,
    select: Any = None,
    zero_at_zero_advantage: bool = True,
    clipped: bool = False,
    **declaration: Any,
) -> Any:
    """Register a surrogate ``fn(logp, old_logp, adv, mask, *, stats=True, **settings) ->
    (per_token [N, T], stats)`` as ``name`` (a decorator without ``fn``).

    ``reads``: ``entropy`` (passed as ``entropy=[N, T]``) and ``step_selection`` (then give
    ``select=``, a function of the step's micro-batch lists, whose result is passed as
    ``selected=``); ``zero_at_zero_advantage=False`` when a row with A = 0 still has a
    gradient (a ratio penalty); ``clipped=True`` when its clip needs ρ ≠ 1 to act.
    """
    reads = surrogate_axis._check_reads(name, declaration.get("reads", ()))
    if "step_selection" in reads and not callable(select):
        raise registry.RegistrationError(
            f"surrogate {name!r} reads step_selection: pass select=fn(logps, old_logps, advs, "
            "masks, **params), the step's selection from lists of micro-batches"
        )
    if select is not None and "step_selection" not in reads:
        raise registry.RegistrationError(
            f"surrogate {name!r} gives select= but does not read step_selection: add "
            "reads={'step_selection'}"
        )
    if "step_selection" in reads:  # the selection comes back by keyword
        declaration["reads"] = reads
    return surrogate_axis.register(
        name,
        fn,
        select=select,
        zero_at_zero_advantage=zero_at_zero_advantage,
        clipped=clipped,
        **declaration,
    )


aggregation_axis = registry.Axis(
    "aggregation",
    AGGREGATIONS,
    positional=("per_token", "mask", "totals"),
    example="(per_token [N, T], mask [N, T], totals: StepTotals | None = None) -> scalar",
)
"""The aggregation axis over :data:`AGGREGATIONS`."""

kl_axis = registry.Axis(
    "KL estimator",
    KL_ESTIMATORS,
    positional=("logp", "ref_logp"),
    example="(logp [N, T], ref_logp [N, T], **settings) -> per-token KL [N, T]",
)
"""The KL-estimator axis over :data:`KL_ESTIMATORS`."""

correction_axis = registry.Axis(
    "rollout correction",
    CORRECTIONS,
    positional=("log_ratio", "mask", "adv"),
    inputs=("current_logp", *correction.LOGP_INPUTS),
    keywords={"current_logp": None},
    skip=correction.LOGP_INPUTS,
    example="(log_ratio [N, T], mask [N, T] bool, adv [N] | None = None, *, **settings) -> "
    "correction.Parts",
)
"""The rollout-correction axis over :data:`CORRECTIONS`: ``reads={"current_logp"}`` makes the
method's log-ratio the current policy's against the rollout engine's, computed per
micro-batch inside the loss (``opsm``); the others run once per batch."""
for _name in correction.USES_CURRENT_POLICY:
    correction_axis.declare(_name, reads={"current_logp"})
for _name, _fn in CORRECTIONS.items():  # the log-probs themselves, as correction.compute gives
    _takes = set(inspect.signature(_fn).parameters) & set(correction.LOGP_INPUTS)
    if _takes:
        correction_axis.declare(_name, reads=_takes)


def register_aggregation(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register an aggregation ``fn(per_token, mask, totals=None) -> scalar`` as ``name``."""
    return aggregation_axis.register(name, fn, **declaration)


def register_kl(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register a KL estimator ``fn(logp, ref_logp, **settings) -> [N, T]`` as ``name``."""
    return kl_axis.register(name, fn, **declaration)


def register_correction(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register a rollout correction ``fn(log_ratio, mask, adv=None, **settings) -> Parts``
    (``reads={"current_logp"}``: computed per micro-batch from the current policy)."""
    return correction_axis.register(name, fn, **declaration)
