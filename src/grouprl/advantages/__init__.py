"""Group-relative advantage estimators and the transforms that compose with them.

    from grouprl import advantages
    out = advantages.compute("maxnorm_rloo", rewards)     # rewards: float [P, G], NaN = missing
    out = advantages.compute("grpo", rewards, focal_gamma=0.5, delta_res=1e-2)
    out = advantages.compute("grpo", rewards, virtual="symmetric", trigger=VirtualTrigger())
    out.values, out.keep, out.kl_weight, out.scale, out.stats
    advantages.compute("gdpo", per_function)              # [P, G, K]: K reward functions
    advantages.compute("opo", rewards, lengths=lengths)   # [P, G] completion tokens
    advantages.compute("remax", rewards, baseline=greedy) # [P] reward of the greedy completion
    advantages.compute_tokens("optimal_token_baseline", rewards, mask, old_logp=..., ...)

Order of application (ALGORITHMS.md §2): reward combination → resolution → virtual samples
→ estimator → focal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from grouprl import registry
from grouprl.advantages import (
    baseline,
    combine,
    global_norm,
    ranking,
    reweighted,
    scale,
    tokens,
    transforms,
)
from grouprl.advantages._groups import (
    DEFAULT_TAU,
    check_positive,
    group_moments,
    keyword_defaults,
    mask_mean,
    shared_moments,
    validate_rewards,
    zero_rows_,
)
from grouprl.advantages.combine import REWARD_COMBINATIONS, weighted_sum
from grouprl.advantages.tokens import TOKEN_ESTIMATORS, TOKEN_REWARDS_AS, kl_reward
from grouprl.advantages.transforms import (
    DEFAULT_DELTA_RES,
    VIRTUAL_MODES,
    VirtualTrigger,
    focal_mean_weight,
    focal_weight,
    resolution,
    virtual_count,
    virtual_samples,
)
from grouprl.types import Advantages

__all__ = [
    "ALIASES",
    "BUILTIN_TRANSFORMS",
    "DEFAULT_DELTA_RES",
    "ESTIMATORS",
    "REWARD_COMBINATIONS",
    "TOKEN_ESTIMATORS",
    "TRANSFORMS",
    "Advantages",
    "VirtualTrigger",
    "combine",
    "compute",
    "compute_tokens",
    "estimator_axis",
    "focal_mean_weight",
    "focal_weight",
    "group_std",
    "kl_reward",
    "names",
    "needs",
    "register_combination",
    "register_estimator",
    "register_token_estimator",
    "register_transform",
    "resolution",
    "token_names",
    "transforms",
    "virtual_count",
    "virtual_samples",
]

ESTIMATORS: dict[str, Callable[..., Advantages]] = {
    "grpo": baseline.grpo,
    "dr_grpo": baseline.dr_grpo,
    "rloo": baseline.rloo,
    "batch_std": baseline.batch_std,
    "reinforce_pp": global_norm.reinforce_pp_baseline,  # alias of reinforce_pp_baseline, kept for old configs
    "gopo": ranking.gopo,
    "p90": scale.p90,
    "maxnorm_rloo": scale.maxnorm_rloo,
    "maxnorm_dr_grpo": scale.maxnorm_dr_grpo,
    "grpo_beta_comp": baseline.grpo_beta_comp,
    "sigma_weighted_grpo": baseline.sigma_weighted_grpo,
    # -- the peers' methods (ALGORITHMS.md §1 "Methods the peers ship")
    "reinforce_pp_baseline": global_norm.reinforce_pp_baseline,
    "reinforce_pp_global": global_norm.reinforce_pp_global,
    "flash_reinforce": global_norm.flash_reinforce,
    "gdpo": global_norm.gdpo,
    "grpo_passk": reweighted.grpo_passk,
    "gpg": reweighted.gpg,
    "opo": reweighted.opo,
    "remax": reweighted.remax,
}
"""Estimator name -> pure function ``(rewards [P, G], valid [P, G], **params) -> Advantages``.

``reinforce_pp`` is an alias of ``reinforce_pp_baseline`` (the same function). Estimators
that read per-sample inputs declare them as keyword parameters: ``lengths [P, G]``
(completion tokens: ``opo``, and ``weighting="token"``) and ``baseline [P]`` (``remax``).
"""

FRESH_VALUES = frozenset({scale.maxnorm_rloo, scale.maxnorm_dr_grpo})
"""Estimators whose ``values`` are always memory they allocated for that call and keep no
reference to: :func:`compute` zeroes the resolution's skipped groups in them in place
instead of in a copy (any other estimator's values are copied first)."""

ALIASES: dict[str, str] = {"reinforce_pp": "reinforce_pp_baseline"}
"""Old name -> current name: ``reinforce_pp`` is an older name of REINFORCE++-baseline,
when REINFORCE++ without a group baseline (``reinforce_pp_global``) joined it."""

INPUTS = ("lengths", "baseline", "verifier_rewards", "draw_weights")
"""Per-batch inputs an estimator may read, passed by :func:`compute` (not parameters)."""

DEFAULT_COMBINATION: dict[str, str] = {"gdpo": "normalize_then_sum"}
"""The reward combination :func:`compute` applies to ``[P, G, K]`` rewards when none is
given: GDPO's own first stage for ``gdpo``, the weighted sum (TRL's default) otherwise."""

TRANSFORMS: dict[str, Callable[..., Any]] = {
    "delta_res": resolution,
    "virtual": virtual_samples,
    "focal_gamma": focal_weight,
}
"""Keyword of :func:`compute` -> the transform it switches on."""


_ADVANTAGE_INPUTS = INPUTS
_INPUT_HINTS = {
    "lengths": "lengths=[P, G] (completion tokens)",
    "baseline": "baseline=[P] (greedy rewards)",
}

estimator_axis = registry.Axis(
    "estimator",
    ESTIMATORS,
    positional=("rewards", "valid"),
    inputs=_ADVANTAGE_INPUTS,
    skip=registry.INPUTS,
    example="(rewards [P, G], valid [P, G] | None, *, **settings) -> Advantages",
)
"""The estimator axis (:class:`grouprl.registry.Axis` over :data:`ESTIMATORS`)."""
estimator_axis.declare("remax", reads={"baseline"})
estimator_axis.declare("opo", reads={"lengths"})

token_estimator_axis = registry.Axis(
    "token estimator",
    TOKEN_ESTIMATORS,
    positional=("rewards", "valid", "mask", "token_rewards"),
    inputs=("old_logp", "sum_pi_squared"),
    skip=(*registry.INPUTS, "is_weights"),
    example="(rewards [P, G], valid, mask [P, G, T], token_rewards [P, G, T], *, **settings) "
    "-> Advantages with token_values",
)
"""The token-level estimator axis (:data:`TOKEN_ESTIMATORS`, ``compute_tokens``)."""
for _name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
    token_estimator_axis.declare(_name, reads={"old_logp", "sum_pi_squared"})

combination_axis = registry.Axis(
    "reward combination",
    REWARD_COMBINATIONS,
    positional=("rewards", "weights"),
    inputs=("reward_parts",),
    example="(rewards [P, G, K], weights [K] | None, **settings) -> [P, G]",
)
"""The reward-combination axis (:data:`REWARD_COMBINATIONS`): every one but ``sum`` reads
each reward function's rewards, so the trainer collects them when the combination is used."""
combination_axis.declare("normalize_then_sum", reads={"reward_parts"})

transform_axis = registry.Axis(
    "transform",
    TRANSFORMS,
    positional=("rewards", "valid", "values"),
    inputs=("trigger", "verifier_rewards"),
    example="(rewards [P, G], valid [P, G] | None, values [P, G], *, **settings) -> [P, G]",
)
"""The transforms: the built-in three are keywords of :func:`compute` (the virtual samples
read the run's trigger, the focal weight the verifier's unshaped rewards); a registered one
(:func:`register_transform`) runs on the estimator's advantages, through ``transforms=``."""

BUILTIN_TRANSFORMS = tuple(TRANSFORMS)
"""The transforms that are keywords of :func:`compute` (``focal_gamma=``...), not entries of
its ``transforms=``."""
transform_axis.declare("virtual", reads={"trigger"})
transform_axis.declare("focal_gamma", reads={"verifier_rewards"})


def register_estimator(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register a sequence-level estimator ``fn(rewards [P, G], valid, *, **settings) ->
    Advantages`` as ``name`` (a decorator without ``fn``); ``reads`` names its inputs among
    lengths, baseline, verifier_rewards and draw_weights, each passed by that keyword
    (:meth:`grouprl.registry.Axis.register`)."""
    return estimator_axis.register(name, fn, **declaration)


def register_token_estimator(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register a token-level estimator ``fn(rewards, valid, mask, token_rewards, *,
    **settings) -> Advantages`` (``reads``: old_logp, sum_pi_squared)."""
    return token_estimator_axis.register(name, fn, **declaration)


def register_combination(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register a reward combination ``fn(rewards [P, G, K], weights, **settings) -> [P, G]``;
    it reads the per-function rewards (``reads={"reward_parts"}`` is implied)."""
    declaration.setdefault("reads", {"reward_parts"})
    return combination_axis.register(name, fn, **declaration)


def register_transform(name: str, fn: Any = None, **declaration: Any) -> Any:
    """Register an advantage transform ``fn(rewards [P, G], valid [P, G] | None, values [P,
    G], *, **settings) -> [P, G]``: it takes the estimator's advantages ``values`` (after the
    focal weight, before a group weight and the resolution skip) and returns new ones; a
    preset turns it on with ``transforms={name: {setting: value}}`` (``reads``: trigger,
    verifier_rewards)."""
    return transform_axis.register(name, fn, **declaration)


def _registered_transforms(
    transforms: Mapping[str, Mapping[str, Any]] | None,
) -> list[tuple[str, Callable[..., Any], dict[str, Any]]]:
    """``(name, fn, settings)`` of each entry of :func:`compute`'s ``transforms=``, checked:
    a registered transform (not a built-in keyword), settings among its own."""
    out = []
    for name, settings in dict(transforms or {}).items():
        if name in BUILTIN_TRANSFORMS:
            raise ValueError(
                f"{name!r} is a built-in transform: pass it as compute()'s {name}= keyword "
                "(a preset's field of that name), not in transforms="
            )
        decl = transform_axis.get(name)  # an unknown name: the error lists the valid ones
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(decl.setting_names()))
        if unknown:
            raise ValueError(
                f"transform {name!r} got unknown setting(s) {unknown}; its settings: "
                f"{', '.join(decl.setting_names()) or 'none'}"
            )
        out.append((name, decl.fn, settings))
    return out


def _apply_registered(
    registered: list[tuple[str, Callable[..., Any], dict[str, Any]]],
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    values: torch.Tensor,
    given: Mapping[str, Any],
) -> torch.Tensor:
    """``values [P, G]`` through each registered transform in turn, each handed the inputs
    it declares (from ``given``); a result of another shape is refused by name."""
    for name, fn, settings in registered:
        reads = {k: given[k] for k in transform_axis.reads(name)}
        out = fn(rewards, valid, values, **reads, **settings)
        if not isinstance(out, torch.Tensor) or out.shape != values.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"transform {name!r} must return the advantages' shape "
                f"{tuple(values.shape)} [P, G], got {got}"
            )
        values = out.to(values.dtype)
    return values


def names() -> list[str]:
    """Every estimator name (sequence level; each also runs through :func:`compute_tokens`)."""
    return list(ESTIMATORS)


def token_names() -> list[str]:
    """Every name :func:`compute_tokens` accepts: the token-level estimators, then the rest."""
    return list(TOKEN_ESTIMATORS) + [n for n in ESTIMATORS if n not in TOKEN_ESTIMATORS]


def needs(name: str, **params: Any) -> frozenset[str]:
    """What estimator ``name`` (with ``params``) reads beyond the rewards: its declaration.

    ``"lengths"`` (completion tokens [P, G]), ``"baseline"`` (greedy reward [P]), ``"tokens"``
    (a token-level estimator: ``compute_tokens`` with the token mask), ``"old_logp"`` and
    ``"sum_pi_squared"`` (the optimal token baseline); ``weighting="token"`` reads the
    lengths. A trainer reads this to know what to collect; an unknown name raises the usual
    error.
    """
    if name in TOKEN_ESTIMATORS and name not in ESTIMATORS:
        return frozenset({"tokens"}) | token_estimator_axis.reads(name)
    accepted = set(keyword_defaults(_estimator(name)))
    out = set(estimator_axis.reads(name))
    if "lengths" in accepted and params.get("weighting") == "token":
        out.add("lengths")
    return frozenset(out)


def _estimator(name: str) -> Callable[..., Advantages]:
    try:
        return ESTIMATORS[name]
    except KeyError:
        if name in TOKEN_ESTIMATORS:
            raise ValueError(
                f"{name!r} is a token-level estimator: call advantages.compute_tokens({name!r}, "
                "rewards, mask, ...) with the completion-token mask [P, G, T]"
            ) from None
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid estimators: {', '.join(ESTIMATORS)}; "
            f"token-level: {', '.join(n for n in TOKEN_ESTIMATORS if n not in ESTIMATORS)}"
        ) from None


def _check_params(fn: Callable[..., Advantages], name: str, params: dict[str, Any]) -> None:
    accepted = set(keyword_defaults(fn)) - set(INPUTS)
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(
            f"estimator {name!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
            f"{sorted(accepted)}, and compute() takes the transforms focal_gamma, delta_res, "
            "virtual (+ trigger, virtual_alpha) and reward_range"
        )
    if "eps" in params:  # 0 is fine: collapsed groups never reach the division
        check_positive("eps", params["eps"], allow_zero=True)
    for key in ("tau", "tau_res"):
        if key in params:
            check_positive(key, params[key])
    if "ddof" in params and params["ddof"] not in (0, 1):
        raise ValueError(
            f"ddof must be 0 (population std) or 1 (Bessel, TRL/verl), got {params['ddof']!r}"
        )


def _check_transforms(focal_gamma, delta_res, virtual, reward_range) -> tuple[float, float]:
    check_positive("focal_gamma", focal_gamma, allow_zero=True)
    if delta_res is not None:
        check_positive("delta_res", delta_res)
    if virtual is not None and virtual not in VIRTUAL_MODES:
        raise ValueError(
            f"unknown virtual mode {virtual!r}; valid modes: {', '.join(VIRTUAL_MODES)}"
        )
    try:
        r_lo, r_hi = (float(x) for x in reward_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"reward_range must be a pair (r_lo, r_hi), got {reward_range!r}"
        ) from None
    if not r_lo < r_hi:
        raise ValueError(f"reward_range must have r_lo < r_hi, got {reward_range!r}")
    return r_lo, r_hi


def _combined(
    name: str,
    rewards: torch.Tensor,
    combine_name: str | None,
    reward_weights: Any,
    combine_params: Mapping[str, Any] | None,
) -> tuple[torch.Tensor, Any, str | None]:
    """``(estimator rewards [P, G], (raw rewards, weights) or the rewards, combination)``.

    A ``[P, G, K]`` batch goes through the reward combination (``combine_name``, else the
    estimator's default); ``[P, G]`` is one function's rewards, combined only when the
    combination is not the plain sum. The *level* rewards are the weighted sum of the raw
    rewards, on the scale ``reward_range`` describes: what the focal weight's success rate
    reads, whatever the combination hands the estimator [OURS].
    """
    how = combine_name or DEFAULT_COMBINATION.get(name)
    three_d = isinstance(rewards, torch.Tensor) and rewards.dim() == 3
    if not three_d and how in (None, "sum"):
        if reward_weights is not None:
            raise ValueError("reward_weights weigh K reward functions: pass rewards as [P, G, K]")
        return rewards, rewards, None
    how = how or "sum"
    if isinstance(rewards, torch.Tensor) and rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)}): nothing to estimate")
    if not three_d and isinstance(rewards, torch.Tensor) and rewards.dim() == 2:
        rewards = rewards.unsqueeze(-1)  # one reward function: [P, G, 1]
    est = combine.combine(how, rewards, reward_weights, **dict(combine_params or {}))
    # the raw rewards stay at hand: their weighted sum is what the focal weight reads
    return est, (rewards, reward_weights), how


def _check_inputs(
    fn: Callable[..., Advantages],
    name: str,
    rewards: torch.Tensor,
    lengths: torch.Tensor | None,
    baseline: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The per-batch inputs the estimator reads, validated (shapes [P, G] and [P])."""
    accepted = set(keyword_defaults(fn))
    out: dict[str, torch.Tensor] = {}
    p, g = rewards.shape
    if baseline is not None:
        if "baseline" not in accepted:
            readers = [n for n, f in ESTIMATORS.items() if "baseline" in keyword_defaults(f)]
            raise ValueError(
                f"estimator {name!r} does not read a baseline; baseline= is for {', '.join(readers)}"
            )
        if not isinstance(baseline, torch.Tensor) or tuple(baseline.shape) != (p,):
            got = tuple(baseline.shape) if isinstance(baseline, torch.Tensor) else baseline
            raise ValueError(f"baseline must be a tensor [P] = [{p}], got {got}")
        if bool(torch.isinf(baseline).any()):
            raise ValueError("baseline contains ±inf; use NaN for a greedy completion not scored")
        out["baseline"] = baseline.to(rewards.device, rewards.dtype)
    if lengths is not None and "lengths" in accepted:
        if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (p, g):
            got = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else lengths
            raise ValueError(f"lengths must be a tensor [P, G] = [{p}, {g}], got {got}")
        if not bool(torch.isfinite(lengths.double()).all()) or bool((lengths < 0).any()):
            raise ValueError("lengths must be finite token counts >= 0")
        out["lengths"] = lengths.to(rewards.device)
    return out


def _declared(reads: frozenset[str], **given: Any) -> dict[str, Any]:
    """The ``given`` inputs a registered estimator declares it reads, by their name."""
    return {k: v for k, v in given.items() if k in reads and v is not None}


def _verifier_levels(
    verifier_rewards: torch.Tensor, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The verifier's rewards ``[P, G]`` and their validity mask, for the focal weight's μ̂."""
    valid = validate_rewards(verifier_rewards)
    if verifier_rewards.shape != shape:
        raise ValueError(
            f"verifier_rewards must have the rewards' shape {tuple(shape)} (the same groups "
            f"before shaping), got {tuple(verifier_rewards.shape)}"
        )
    return verifier_rewards, valid


def _weighted(values: torch.Tensor, group_weight: Any, stats: dict[str, float]) -> torch.Tensor:
    """``values [P, G]`` times a positive finite weight per group ``[P]`` (logged as its mean)."""
    gw = torch.as_tensor(group_weight, device=values.device)
    if gw.shape != (values.shape[0],) or not bool(torch.isfinite(gw).all() and (gw > 0).all()):
        raise ValueError(
            f"group_weight must be [P] = [{values.shape[0]}] positive finite weights (one per "
            f"group, e.g. the sampler's importance weights), got shape {tuple(gw.shape)}"
        )
    stats["sampler/importance_weight_mean"] = float(gw.double().mean())
    return values * gw.to(values.dtype)[:, None]


def _row_major(x: Any) -> Any:
    """A reward tensor in row-major memory (itself when it already is): a row's sum, and so
    every statistic, then adds in one order whatever view the caller passed ([OURS]: a
    transposed or sliced view would otherwise round differently, by an ulp here and there)."""
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def _constant(rewards: Any) -> Any:
    """The rewards as constants of the loss (stop-gradient, ALGORITHMS.md §1): no gradient
    reaches them, and the estimators may work in place on what they were given. Detached only
    when they carry a graph: a new tensor object would lose what the reward combination
    handed the estimator for them (``_groups.hand_columns``)."""
    if isinstance(rewards, torch.Tensor) and rewards.requires_grad:
        return rewards.detach()
    return rewards


def _sharing_moments(fn: Callable[..., Advantages]) -> Callable[..., Advantages]:
    """Run ``fn`` inside :func:`shared_moments`: the virtual-sample trigger and the estimator
    compute the group moments of one batch once."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Advantages:
        with shared_moments():
            return fn(*args, **kwargs)

    return wrapper


@_sharing_moments
def compute(
    name: str,
    rewards: torch.Tensor,
    *,
    focal_gamma: float = 0.0,
    delta_res: float | None = None,
    virtual: str | None = None,
    trigger: VirtualTrigger | None = None,
    virtual_alpha: float = 0.5,
    virtual_batch_groups: int | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
    lengths: torch.Tensor | None = None,
    baseline: torch.Tensor | None = None,
    combine: str | None = None,
    reward_weights: Any = None,
    combine_params: Mapping[str, Any] | None = None,
    verifier_rewards: torch.Tensor | None = None,
    group_weight: torch.Tensor | None = None,
    draw_weights: torch.Tensor | None = None,
    transforms: Mapping[str, Mapping[str, Any]] | None = None,
    **params: Any,
) -> Advantages:
    """Advantages of estimator ``name`` for ``rewards [P, G]`` (NaN = missing), with transforms.

    Args:
        name: one of :func:`names`.
        rewards: float ``[P, G]``; NaN entries are excluded from every statistic and get 0.
            ``[P, G, K]``: K reward functions' rewards (NaN = the function returned None),
            combined first by ``combine`` (ALGORITHMS.md §1, "Reward combination").
        focal_gamma: F-GRPO focal exponent γ (0 = off; presets use 0.5).
        delta_res: MaxNorm resolution protocol bin width (None = off; paper 1e-2). Estimators
            with a scale floor (``tau_res``) default it to ``delta_res`` when it is set.
        virtual: AVSPO virtual samples, ``"symmetric" | "paper" | "code"`` (None = off).
        trigger: AVSPO's adaptive threshold state; read for the decision, then advanced once
            with this batch's ACR and mean reward. None: a fixed τ_adapt = 0.5.
        virtual_alpha: exponent α in K = ⌈G·ACR^α⌉ (ACR paper: 0.5).
        virtual_batch_groups: ``virtual="code"`` only: groups per generation batch whose
            rewards the code rule looks at together (None = the whole batch; the authors'
            script runs 1, see ``transforms.virtual_samples``).
        reward_range: ``(r_lo, r_hi)``, what "wrong" and "correct" are (default [0, 1]).
        lengths: ``[P, G]`` completion tokens per sample, for the estimators that read them
            (``opo``; ``weighting="token"``); ignored by the others (:func:`needs`).
        baseline: ``[P]`` reward of each prompt's greedy completion (``remax`` only).
        combine: reward combination of ``[P, G, K]`` rewards (``REWARD_COMBINATIONS``; None:
            ``normalize_then_sum`` for ``gdpo``, ``sum`` otherwise); given with ``[P, G]``
            rewards, they are one function's.
        reward_weights: ``[K]`` weights of the reward functions (None: all 1, TRL's default).
        combine_params: parameters of the combination (``normalize_then_sum``: ``eps``...).
        verifier_rewards: ``[P, G]`` the verifier's rewards before any shaping (DAPO's soft
            overlong penalty), NaN where unscorable; the focal weight's μ̂ reads these, never
            the shaped ``rewards`` (F-GRPO eq. 11: μ̂ = X/N, the share of correct rollouts).
            None: ``rewards`` are the verifier's.
        group_weight: ``[P]`` positive finite weight per group, multiplying its advantages
            after every other transform: the prompt sampler's importance weight
            1/(|pool|·p_x) (``sampling.PromptSampler.importance_weights``, ``is_grpo_exact``).
            None: 1.
        draw_weights: ``[P]`` the same importance weights, handed to an estimator that
            declares ``reads={"draw_weights"}`` (never multiplied in here).
        transforms: registered transforms (:func:`register_transform`) and their settings,
            ``{name: {setting: value}}``, applied in order to the advantages after the focal
            weight and before ``group_weight``; each gets the rewards the estimator saw (real
            samples), their valid mask, the advantages, and what it declares it reads.
        **params: the estimator's own parameters (``eps``, ``ddof``, ``tau``, ``tau_res``...).
    """
    fn = _estimator(name)
    rewards, verifier_rewards = _row_major(rewards), _row_major(verifier_rewards)
    lengths = _row_major(lengths)
    rewards, level, how = _combined(name, rewards, combine, reward_weights, combine_params)
    rewards = _constant(rewards)
    r_lo, r_hi = _check_transforms(focal_gamma, delta_res, virtual, reward_range)
    registered = _registered_transforms(transforms)
    if how not in (None, "sum") and (delta_res is not None or virtual is not None):
        raise ValueError(
            f"the reward combination {how!r} hands the estimator normalised rewards, which "
            "have no resolution and no correct/wrong levels: delta_res and virtual work on "
            "combine='sum' only [OURS]"
        )
    if delta_res is not None and "tau_res" in keyword_defaults(fn):
        params.setdefault("tau_res", delta_res)
    _check_params(fn, name, params)
    valid = validate_rewards(rewards)  # None: every reward valid (fast path)
    inputs = _check_inputs(fn, name, rewards, lengths, baseline)
    reads = needs(name, **params)
    inputs.update(_declared(reads, verifier_rewards=verifier_rewards, draw_weights=draw_weights))
    missing = reads - set(inputs)
    if missing:
        raise ValueError(
            f"estimator {name!r} reads {', '.join(sorted(missing))}: pass "
            + " and ".join(
                _INPUT_HINTS.get(k, f"{k}= ({registry.INPUTS[k]})") for k in sorted(missing)
            )
        )
    if virtual is not None and reads:
        raise ValueError(
            f"virtual samples have no tokens and no greedy completion; {name!r} reads "
            f"{', '.join(sorted(reads))} [OURS: the two do not combine]"
        )
    inputs = {k: v for k, v in inputs.items() if k in reads or k == "lengths"}
    g = rewards.shape[1]
    nan_frac = 0.0 if valid is None else 1.0 - int(valid.count_nonzero()) / valid.numel()
    stats: dict[str, float] = {"nan_frac": nan_frac}
    if how is not None:
        stats[f"combine/{how}"] = 1.0
    keep = None  # [P] bool; None = every group kept

    # -- resolution: merge sub-resolution gaps, skip one-bin groups for both branches
    if delta_res is not None:
        rewards, keep = resolution(rewards, valid, delta_res)
        stats["resolution/skipped_frac"] = mask_mean(~keep)

    # -- virtual samples: extra columns that enter the statistics only
    est_rewards, est_valid = rewards, valid
    if virtual is not None:
        tau_adapt = trigger.tau if trigger is not None else 0.5
        est_rewards, est_valid, vstats = virtual_samples(
            rewards,
            valid,
            mode=virtual,
            tau_adapt=tau_adapt,
            alpha=virtual_alpha,
            reward_range=(r_lo, r_hi),
            tau=params.get("tau", DEFAULT_TAU),
            ddof=params.get("ddof", 1),
            batch_groups=virtual_batch_groups,
        )
        stats.update(vstats)
        if trigger is not None:
            mean_reward = float(rewards.nanmean()) if nan_frac < 1 else 0.0
            stats["virtual/tau_adapt_next"] = trigger.update(vstats["virtual/acr"], mean_reward)

    # -- estimator
    out = fn(est_rewards, est_valid, **inputs, **params)
    values = out.values[:, :g]  # [P, G] real samples only
    stats.update(out.stats)

    # -- focal weight: one scalar per group, from the verifier's (unshaped) real rewards; on
    # the reward levels (the raw weighted sum) when the combination normalises
    if focal_gamma:
        if verifier_rewards is not None:
            lv, lvalid = _verifier_levels(verifier_rewards, values.shape)
        elif how in (None, "sum"):
            lv, lvalid = rewards, valid
        else:
            lv = weighted_sum(*level)  # (``combine`` is this function's argument here)
            lvalid = validate_rewards(lv)
        weight = focal_weight(lv, lvalid, focal_gamma, (r_lo, r_hi))  # [P]
        values = values * weight[:, None]
        stats["focal/mean_weight"] = float(weight.mean())

    given = {"trigger": trigger, "verifier_rewards": verifier_rewards}
    values = _apply_registered(registered, rewards, valid, values, given)  # the plugins', in order

    if group_weight is not None:
        values = _weighted(values, group_weight, stats)

    updated = out.updated
    if updated is None:  # an estimator that does not say: the kept groups with a signal
        updated = out.keep & (values != 0).any(-1)
    if keep is None:
        keep = out.keep
    else:
        values = _zero_skipped(fn, out.values, values, keep)
        updated = updated & keep
    stats["updated_frac"] = mask_mean(updated)
    return Advantages(values, keep, out.kl_weight, out.scale, stats, updated)


def _zero_skipped(
    fn: Callable[..., Advantages], own: torch.Tensor, values: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``values [P, G]`` with the groups the resolution skips (``keep [P]`` False) zeroed: in
    place when they are the memory of ``own``, the values of an estimator in
    :data:`FRESH_VALUES`, else in a copy (the values may be memory someone keeps)."""
    if not (
        fn in FRESH_VALUES
        and values.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
    ):
        values = values.clone()
    return zero_rows_(values, ~keep)


def _check_mask(mask: Any, p: int, g: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3 or tuple(mask.shape[:2]) != (p, g):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must be the completion-token mask [P, G, T] with [P, G] = [{p}, {g}], got "
            f"{got}; a flat [N, T] mask needs mask.view(P, G, -1)"
        )
    if mask.dtype != torch.bool:
        mask = mask != 0
    return mask


def _check_token_tensor(name: str, x: Any, mask: torch.Tensor, dtype) -> torch.Tensor | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(mask.shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {got}")
    x = torch.where(mask, x.to(mask.device, dtype), 0.0)  # masked_fill(~mask) took ~1.3x
    # a finite sum has finite terms; a sum that overflowed is checked term by term
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} is not finite at a valid (mask = 1) token")
    return x


def compute_tokens(
    name: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    token_rewards_as: str | None = None,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    baseline: torch.Tensor | None = None,
    combine: str | None = None,
    reward_weights: Any = None,
    combine_params: Mapping[str, Any] | None = None,
    **params: Any,
) -> Advantages:
    """Per-token advantages ``token_values [P, G, T]`` (ALGORITHMS.md §1, token level).

    Args:
        name: a token-level estimator (``TOKEN_ESTIMATORS``) or any estimator of
            :func:`names`, which runs on sequence rewards and is broadcast over the tokens.
        rewards: outcome rewards ``[P, G]`` (or ``[P, G, K]``, combined as in :func:`compute`),
            NaN = missing; each sits on its completion's last valid token.
        mask: ``[P, G, T]`` completion-token mask (bool or 0/1; holes allowed).
        token_rewards: ``[P, G, T]`` dense rewards (e.g. ``-β·KL`` from :func:`kl_reward`).
        token_rewards_as: for a sequence-level estimator with ``token_rewards``: ``"score"``
            (verl: summed into the score first) or ``"return"`` (OpenRLHF; verl ReMax: the
            dense rewards' reward-to-go added per token). None: ``"return"`` for ``remax``,
            ``"score"`` otherwise. Token estimators take their own reading as a parameter.
        old_logp, sum_pi_squared, is_weights: ``[P, G, T]`` inputs of the optimal token
            baseline (behaviour log-probs, Σ_v π², rollout IS weights).
        baseline: ``[P]`` greedy rewards (``remax``).
        **params: the estimator's parameters; for a sequence-level estimator also every
            keyword of :func:`compute` (transforms).
    """
    fn_tok = TOKEN_ESTIMATORS.get(name)
    if fn_tok is None:
        _estimator(name)  # the usual error for an unknown name
    rewards, mask, token_rewards = _row_major(rewards), _row_major(mask), _row_major(token_rewards)
    old_logp, sum_pi_squared = _row_major(old_logp), _row_major(sum_pi_squared)
    is_weights = _row_major(is_weights)
    combined, _, how = _combined(name, rewards, combine, reward_weights, combine_params)
    valid = validate_rewards(combined)
    p, g = combined.shape
    mask = _check_mask(mask, p, g).to(combined.device)
    dense = _check_token_tensor("token_rewards", token_rewards, mask, combined.dtype)
    if fn_tok is not None:
        if dense is None:
            dense = torch.zeros(mask.shape, dtype=combined.dtype, device=combined.device)
        out = _token_estimate(
            name,
            fn_tok,
            combined,
            valid,
            mask,
            dense,
            old_logp,
            sum_pi_squared,
            is_weights,
            baseline,
            token_rewards_as,
            params,
        )
    else:
        if old_logp is not None or sum_pi_squared is not None or is_weights is not None:
            raise ValueError(
                f"{name!r} is a sequence-level estimator: old_logp / sum_pi_squared / "
                "is_weights are read by the optimal token baseline only"
            )
        how_kw = {
            "combine": combine,
            "reward_weights": reward_weights,
            "combine_params": combine_params,
        }
        out = _broadcast(
            name, rewards, combined, how, mask, dense, token_rewards_as, baseline, how_kw, params
        )
    stats = dict(out.stats)
    stats.setdefault("nan_frac", 0.0 if valid is None else mask_mean(~valid))
    updated = out.updated if out.updated is not None else out.keep
    stats["updated_frac"] = mask_mean(updated)
    if how is not None:
        stats[f"combine/{how}"] = 1.0
    return Advantages(
        out.values, out.keep, out.kl_weight, out.scale, stats, updated, out.token_values
    )


def _token_estimate(
    name,
    fn,
    rewards,
    valid,
    mask,
    dense,
    old_logp,
    sum_pi_squared,
    is_weights,
    baseline,
    token_rewards_as,
    params,
):
    accepted = set(keyword_defaults(fn))
    if baseline is not None:
        raise ValueError(f"token estimator {name!r} does not read a baseline (remax does)")
    if token_rewards_as is not None:
        if "token_rewards_as" not in accepted:
            raise ValueError(f"{name!r} has one reading of token rewards; drop token_rewards_as")
        params["token_rewards_as"] = token_rewards_as
    extra = {"old_logp": old_logp, "sum_pi_squared": sum_pi_squared, "is_weights": is_weights}
    for key, x in extra.items():
        if x is not None and key not in accepted:
            raise ValueError(f"token estimator {name!r} does not read {key}")
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(
            f"token estimator {name!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
            f"{sorted(accepted - set(extra))}"
        )
    if "eps" in params:
        check_positive("eps", params["eps"], allow_zero=True)
    if "gamma" in params and not 0.0 <= float(params["gamma"]) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {params['gamma']!r}")
    inputs = {
        k: _check_token_tensor(k, x, mask, rewards.dtype) for k, x in extra.items() if x is not None
    }
    return fn(rewards, valid, mask, dense, **inputs, **params)


def _broadcast(name, raw, combined, how, mask, dense, token_rewards_as, baseline, how_kw, params):
    """A sequence-level estimator on tokens: verl's "score" or OpenRLHF's "return" reading."""
    reading = token_rewards_as or ("return" if name == "remax" else "score")
    if reading not in TOKEN_REWARDS_AS:
        raise ValueError(
            f"unknown token_rewards_as {reading!r}; valid: {', '.join(TOKEN_REWARDS_AS)}"
        )
    lengths = mask.sum(-1)  # [P, G]
    if dense is not None and reading == "score":
        if how not in (None, "sum"):
            raise ValueError(
                f"dense token rewards cannot join the {how!r} combination's normalised "
                "rewards as a score [OURS]: pass token_rewards_as='return'"
            )
        out = compute(name, combined + dense.sum(-1), lengths=lengths, baseline=baseline, **params)
    else:
        out = compute(name, raw, lengths=lengths, baseline=baseline, **how_kw, **params)
    m = mask.to(combined.dtype)
    tok = out.values[..., None] * m  # [P, G, T]
    values = out.values
    if dense is not None and reading == "return":
        alive = (~torch.isnan(combined)) & out.keep[:, None]  # [P, G]
        tok = tok + tokens.reward_to_go(dense, mask) * alive[..., None]
        values = tokens.sequence_mean(tok, mask)
    return Advantages(values, out.keep, out.kl_weight, out.scale, out.stats, out.updated, tok)


def group_std(rewards: torch.Tensor, *, ddof: int = 1) -> torch.Tensor:
    """``[P]`` std of each group's valid rewards (``ddof`` 1 as in §0); NaN with fewer than 2.

    The within-group reward std σ_q that GRPO divides by, as a plain statistic (no eps, no
    collapse threshold): what the IS-GRPO prompt sampler observes (``grouprl.sampling``).
    """
    valid = validate_rewards(rewards)
    m = group_moments(rewards, valid, ddof)
    return m.std.masked_fill(m.count < 2, float("nan"))
