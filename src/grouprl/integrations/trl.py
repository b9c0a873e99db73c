"""grouprl's diagnostics, advantages and (where a preset needs it) loss inside TRL's GRPOTrainer.

    from grouprl.integrations.trl import GroupRLGRPOTrainer
    trainer = GroupRLGRPOTrainer(model, reward_funcs, GRPOConfig(...), train_dataset)
    trainer = GroupRLGRPOTrainer(model, reward_funcs, GRPOConfig(...), train_dataset,
                                 preset="maxnorm_rloo")
    trainer.train()

With no ``preset=`` / ``estimator=`` the trainer is TRL 1.16's ``GRPOTrainer`` on the user's
``GRPOConfig`` (TRL's own advantage step and loss, untouched) with the diagnostics below
added; the estimator equal to TRL's rule (:func:`trl_estimator`) supplies their statistics.
With a preset or estimator, what changes against a plain ``GRPOTrainer`` (the least invasive
overrides TRL 1.x allows; TRL has no advantage hook):

- ``_calculate_rewards`` is wrapped to keep the gathered ``[B·G, n_funcs]`` reward matrix;
  ``_generate_and_score_completions`` runs TRL's own step unchanged, then *replaces* the
  ``advantages`` it returns by :func:`grouprl.advantages.compute` on the same rewards,
  reshaped ``[P, G, n_funcs]`` (TRL's batches are prompt-major) with TRL's
  ``reward_weights``: the estimator's reward combination (``sum`` = TRL's
  ``sum_then_normalize``: weighted ``nansum``, NaN where every function returned None;
  ``normalize_then_sum`` for ``gdpo``, TRL's GDPO) and, for ``opo`` or ``weighting="token"``,
  the gathered completion lengths. The
  AVSPO trigger advances once per generation batch in training, is only read in
  evaluation, and is saved in every checkpoint (``grouprl_state.json``).
- The preset's loss half is mapped onto TRL's own knobs when TRL can express it
  (:func:`trl_loss_settings`: ``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``,
  ``importance_sampling_level``, ``sapo_temperature_*``, ``vespo_*``,
  ``use_bias_correction_kl``); otherwise (``reinforce``, ``gmpo``, ``clip_cov``, ``kl_cov``,
  ``dppo_*``, ``dro``, a k1/k2 KL, a per-group KL weight or group skip with β > 0)
  ``_compute_loss`` computes :func:`grouprl.losses.objective` with TRL's log-probabilities,
  TRL's normalisers, its ``top_entropy_quantile`` (the threshold over each micro-batch on each
  process, where TRL gathers the micro-batch across processes), its
  ``use_bias_correction_kl`` (``kl_correction="ratio"``, or ``"sequence_ratio"`` at
  ``importance_sampling_level="sequence"``) and TRL's rollout corrections (the vLLM
  importance-sampling ratio of ``vllm_importance_sampling_mode`` and DeepSeek-V3.2's
  ``off_policy_mask_threshold``) as its ``correction_weight``, exactly as TRL's own loss
  applies them.
- :class:`GroupRLDiagnosticsCallback` adds ``grouprl/*`` metrics (ACR split, inverse-scale
  tails, tail-miss risk, estimator stats; with vLLM log-probs the ``mismatch/*`` metrics of
  :func:`grouprl.diagnostics.mismatch_metrics`, raw ratio quantiles included) to TRL's metric
  buffer, so they are averaged and logged next to TRL's own (``reward``, ``kl``,
  ``entropy``, ``clip_ratio/*``, ``sampling/*``...), and turns them into
  :class:`grouprl.diagnostics.RunHealth` warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from grouprl import advantages as adv_lib
from grouprl import diagnostics
from grouprl import losses as loss_lib
from grouprl import presets as preset_lib
from grouprl.advantages import VirtualTrigger
from grouprl.presets import Preset
from grouprl.types import Advantages

try:
    from transformers import TrainerCallback
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "grouprl.integrations.trl needs TRL >= 1.0: run scripts/install-peers.sh or "
        "`pip install 'grouprl[peers]'`"
    ) from err

__all__ = [
    "STATE_FILE",
    "TRL_AGGREGATIONS",
    "TRL_LOSS_TYPES",
    "GroupRLDiagnosticsCallback",
    "GroupRLGRPOTrainer",
    "combine_rewards",
    "resolve_preset",
    "schedule_note",
    "trl_loss_settings",
    "trl_schedule",
]

log = logging.getLogger(__name__)

STATE_FILE = "grouprl_state.json"
"""File in each checkpoint folder holding the AVSPO trigger and RunHealth state."""

TRL_LOSS_TYPES: dict[str, str] = {
    "seq_mean_token_mean": "grpo",
    "token_mean": "dapo",
    "seq_mean_token_sum_norm": "dr_grpo",
    "seq_mean_token_sum": "luspo",
    "micro_token_mean": "bnpo",
}
"""Our aggregation -> TRL ``loss_type`` of the PPO-clip family with the same normaliser (TRL
1.x ``_compute_loss``: ``grpo`` per-sequence token mean, ``dapo`` token mean over the optimizer
step, ``dr_grpo`` sum / (B · max_completion_length), ``luspo`` mean over sequences of the token
sums, ``bnpo`` each micro-batch's own token mean)."""

TAIL_MISS_RHO = 0.1
"""Share of a prompt's correct mass held by rare modes for the tail-miss risk
(:func:`grouprl.diagnostics.advise_group_size`'s default) [OURS]."""


# --------------------------------------------------------------------------- presets -> TRL
def resolve_preset(
    preset: str | Preset | None,
    estimator: str | None,
    advantage_kwargs: Mapping[str, Any] | None = None,
) -> Preset:
    """The preset to run: a preset (name or object), or the ``grpo`` preset with ``estimator``.

    ``advantage_kwargs`` (focal_gamma, delta_res, virtual, estimator parameters) override the
    preset's advantage half. Exactly one of ``preset`` / ``estimator`` must be given.
    """
    if (preset is None) == (estimator is None):
        raise ValueError(
            "give exactly one of preset= (a grouprl preset name, e.g. 'f_grpo') or "
            f"estimator= (one of {', '.join(adv_lib.names())})"
        )
    if estimator is not None:
        if estimator not in adv_lib.ESTIMATORS:
            raise ValueError(
                f"unknown advantage estimator {estimator!r}; valid estimators: "
                f"{', '.join(adv_lib.names())}"
                + (
                    " (token-level estimators need per-token inputs TRL does not produce)"
                    if estimator in adv_lib.TOKEN_ESTIMATORS
                    else ""
                )
            )
        base = preset_lib.get("grpo").with_(name=estimator, estimator=estimator)
    else:
        base = preset if isinstance(preset, Preset) else preset_lib.get(preset)
    if not advantage_kwargs:
        return base
    kw = dict(advantage_kwargs)
    changes: dict[str, Any] = {}
    for key in ("focal_gamma", "delta_res", "virtual"):
        if key in kw:
            changes[key] = kw.pop(key)
    if "combine" in kw:
        changes["reward_combination"] = kw.pop("combine")
    if kw:
        changes["estimator_params"] = {**dict(base.estimator_params), **kw}
    return base.with_(**changes)


def trl_schedule(args: Any) -> tuple[int, int]:
    """(minibatches, epochs) per generation batch that a ``GRPOConfig`` runs.

    TRL 1.16 generates one batch every ``steps_per_generation`` micro-steps and takes an
    optimizer step every ``gradient_accumulation_steps`` of them, over ``num_iterations``
    passes (``GRPOConfig``, ``grpo_trainer.py`` ``_prepare_inputs``): minibatches =
    steps_per_generation / gradient_accumulation_steps, epochs = num_iterations.
    """
    accum = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
    per_gen = int(getattr(args, "steps_per_generation", None) or accum)
    return max(1, per_gen // accum), int(getattr(args, "num_iterations", 1) or 1)


def schedule_note(spec: Preset, args: Any) -> str | None:
    """A warning when the GRPOConfig's update schedule is not the preset's sources' one.

    The adapter does not change batch sizes itself (they decide memory and the data order):
    the note says which ``GRPOConfig`` fields give the preset's schedule (ALGORITHMS.md §3).
    """
    have = trl_schedule(args)
    want = (spec.minibatches, spec.ppo_epochs)
    if have == want:
        return None
    accum = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
    return (
        f"preset {spec.name!r}: its sources run {want[0]} minibatch(es) x {want[1]} epoch(s) "
        f"per generation batch, this GRPOConfig runs {have[0]} x {have[1]}; for the preset's "
        f"schedule set GRPOConfig(steps_per_generation={want[0] * accum}, "
        f"num_iterations={want[1]}) (with gradient_accumulation_steps={accum})"
    )


def _clip_family(preset: Preset, params: dict[str, Any]) -> dict[str, Any] | None:
    """TRL settings for ``ppo_clip`` / ``gspo`` (TRL's grpo, dapo, dr_grpo, luspo, bnpo)."""
    loss_type = TRL_LOSS_TYPES.get(preset.aggregation)
    if loss_type is None:
        return None
    defaults = (3e-4, 4e-4) if preset.surrogate == "gspo" else (0.2, 0.2)
    eps_low = float(params.get("eps_low", defaults[0]))
    eps_high = float(params.get("eps_high", defaults[1]))
    dual = params.get("clip_ratio_c")
    # TRL's two-sided delta caps the unclipped ratio; for delta >= 1 + eps_high that is the dual
    # clip c = delta (tests/losses/test_peer_parity_methods.py); below, TRL has no equivalent
    if dual is not None and float(dual) < 1.0 + eps_high:
        return None
    return {
        "loss_type": loss_type,
        "epsilon": eps_low,
        "epsilon_high": eps_high,
        "importance_sampling_level": "sequence" if preset.surrogate == "gspo" else "token",
        "delta": None if dual is None else float(dual),
    }


def _soft_family(preset: Preset, params: dict[str, Any]) -> dict[str, Any] | None:
    """TRL settings for ``sapo`` (normalised as TRL's grpo) and ``vespo`` (as its dapo)."""
    if preset.surrogate == "sapo":
        if preset.aggregation != "seq_mean_token_mean" or "log_ratio_clamp" in params:
            return None
        return {
            "loss_type": "sapo",
            "sapo_temperature_pos": float(params.get("tau_pos", 1.0)),
            "sapo_temperature_neg": float(params.get("tau_neg", 1.05)),
            "importance_sampling_level": params.get("level", "token"),
        }
    known = {"k_pos", "lambda_pos", "k_neg", "lambda_neg"}
    if preset.aggregation != "token_mean" or set(params) - known:
        return None
    defaults = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    out: dict[str, Any] = {"loss_type": "vespo", "importance_sampling_level": "token"}
    out.update({f"vespo_{k}": float(params.get(k, v)) for k, v in defaults.items()})
    return out


def trl_loss_settings(preset: Preset) -> dict[str, Any] | None:
    """``GRPOConfig`` fields that make TRL's own loss compute ``preset``'s loss half, or None.

    TRL 1.x expresses: ``ppo_clip`` and ``gspo`` (``importance_sampling_level="sequence"``)
    with any aggregation of :data:`TRL_LOSS_TYPES`, a dual clip ``c ≥ 1 + ε_high`` as TRL's
    two-sided ``delta``; ``cispo`` with the token mean and no lower weight bound (TRL clips
    the weight from above only); ``sapo`` with the per-sequence token mean; ``vespo`` with the
    token mean. None otherwise (``reinforce``, ``gmpo`` — TRL's GMPO is a separate trainer
    class —, ``clip_cov``, ``kl_cov``, ``dppo_*``, ``dro``, a KL other than TRL's k3 with
    β > 0), and the trainer runs :func:`grouprl.losses.objective` instead. The preset's KL
    term is the plain estimator, so ``use_bias_correction_kl`` is set to False (TRL's default
    is True: its KL gradient would otherwise carry the ratio weight). TRL does not clamp
    ``log s`` at 10 for GSPO as verl and we do; identical below that.
    """
    params = dict(preset.surrogate_params)
    if preset.beta > 0 and preset.kl != "k3":
        return None
    common = {"beta": float(preset.beta), "use_bias_correction_kl": False}
    if preset.surrogate in ("ppo_clip", "gspo"):
        settings = _clip_family(preset, params)
    elif preset.surrogate in ("sapo", "vespo"):
        settings = _soft_family(preset, params)
    elif preset.surrogate == "cispo":
        if preset.aggregation != "token_mean" or float(params.get("eps_low", 1.0)) < 1.0:
            return None
        settings = {
            "loss_type": "cispo",
            "epsilon": 0.2,
            "epsilon_high": 1.0 + float(params.get("eps_high", 5.0)),
            "importance_sampling_level": "token",
        }
    else:
        return None
    return None if settings is None else {**settings, **common}


def _needs_grouprl_loss(preset: Preset) -> bool:
    """True when TRL's loss cannot reproduce the preset (see :func:`trl_loss_settings`)."""
    if trl_loss_settings(preset) is None:
        return True
    # A per-group KL weight or a skipped group must reach the KL branch too.
    return preset.beta > 0 and (
        preset.estimator == "grpo_beta_comp" or preset.delta_res is not None
    )


# --------------------------------------------------------------------------- TRL -> grouprl
TRL_EPS = 1e-4
"""TRL 1.16's advantage denominator offset: ``(r − mean) / (std + 1e-4)`` in every
``scale_rewards`` mode and both ``multi_objective_aggregation`` stages (grpo_trainer.py
``_generate_and_score_completions``)."""


def trl_epsilon_high(args: Any) -> float:
    """TRL's upper clip bound: ``epsilon_high``, or ``epsilon`` when unset (GRPOTrainer)."""
    high = getattr(args, "epsilon_high", None)
    return float(args.epsilon if high is None else high)


def trl_estimator(args: Any) -> tuple[str, dict[str, Any]]:
    """The grouprl estimator (name, parameters) that computes TRL's advantages under ``args``.

    TRL 1.16 (grpo_trainer.py ``_generate_and_score_completions``), std with Bessel's
    correction and ``+ 1e-4``: ``sum_then_normalize`` with ``scale_rewards="group"`` is
    ``grpo`` (eps 1e-4), ``"batch"`` is ``batch_std`` (the group mean over the batch std),
    ``"none"`` is ``dr_grpo``; ``normalize_then_sum`` is ``gdpo`` with the residual of an
    all-equal group kept (``zero_collapsed=False``, as TRL leaves it).
    """
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if aggregation == "normalize_then_sum":
        return "gdpo", {"eps": TRL_EPS, "zero_collapsed": False}
    if aggregation != "sum_then_normalize":
        raise ValueError(
            f"GRPOConfig(multi_objective_aggregation={aggregation!r}) is not one of TRL's "
            "'sum_then_normalize', 'normalize_then_sum'"
        )
    scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
    if scale == "group":
        return "grpo", {"eps": TRL_EPS}
    if scale == "batch":
        return "batch_std", {"eps": TRL_EPS}
    if scale == "none":
        return "dr_grpo", {}
    raise ValueError(
        f"GRPOConfig(scale_rewards={args.scale_rewards!r}) is not one of TRL's 'group', "
        "'batch', 'none'"
    )


def trl_loss_half(args: Any) -> dict[str, Any]:
    """The grouprl loss half (``surrogate``, ``surrogate_params``, ``aggregation``, ``beta``)
    that computes TRL's ``_compute_loss`` under ``args``; the inverse of
    :func:`trl_loss_settings`.

    TRL 1.16 ``_compute_loss``: the PPO clip family (``grpo``, ``dapo``, ``dr_grpo``,
    ``luspo``, ``bnpo``; ``importance_sampling_level="sequence"`` = GSPO's sequence ratio;
    a two-sided ``delta`` ≥ 1 + ε_high = the dual clip c), ``cispo`` (weight clipped above at
    ``epsilon_high``, an absolute bound), ``sapo``, ``vespo``. A ``ValueError`` names the
    setting grouprl's loss does not express (a ``delta`` below 1 + ε_high, CISPO at the
    sequence level).
    """
    loss_type = args.loss_type
    level = args.importance_sampling_level
    eps_low, eps_high = float(args.epsilon), trl_epsilon_high(args)
    aggregations = {v: k for k, v in TRL_LOSS_TYPES.items()}
    common = {"beta": float(args.beta), "kl": "k3"}
    if loss_type in aggregations:
        params: dict[str, Any] = {"eps_low": eps_low, "eps_high": eps_high}
        if args.delta is not None:
            if float(args.delta) < 1.0 + eps_high:
                raise ValueError(
                    f"GRPOConfig(delta={args.delta}) below 1 + epsilon_high = {1 + eps_high} "
                    "caps the ratio of positive advantages too; grouprl's dual clip does not: "
                    "use loss='trl' or delta >= 1 + epsilon_high"
                )
            params["clip_ratio_c"] = float(args.delta)
        surrogate = "gspo" if level == "sequence" else "ppo_clip"
        return {
            "surrogate": surrogate,
            "surrogate_params": params,
            "aggregation": aggregations[loss_type],
            **common,
        }
    if loss_type == "cispo":
        if level != "token":
            raise ValueError(
                "GRPOConfig(loss_type='cispo', importance_sampling_level='sequence') has no "
                "grouprl equivalent (CISPO clips token weights): use loss='trl'"
            )
        if eps_high < 1.0:
            raise ValueError(
                f"GRPOConfig(loss_type='cispo', epsilon_high={eps_high}) caps every token's "
                "weight below 1 (TRL's CISPO bound is absolute); grouprl's CISPO caps it at "
                "1 + eps_high >= 1: set epsilon_high >= 1 (TRL and ScaleRL recommend 5.0) or "
                "use loss='trl'"
            )
        return {
            "surrogate": "cispo",
            "surrogate_params": {"eps_low": 1.0, "eps_high": eps_high - 1.0},
            "aggregation": "token_mean",
            **common,
        }
    if loss_type == "sapo":
        return {
            "surrogate": "sapo",
            "surrogate_params": {
                "tau_pos": float(args.sapo_temperature_pos),
                "tau_neg": float(args.sapo_temperature_neg),
                "level": level,
            },
            "aggregation": "seq_mean_token_mean",
            **common,
        }
    if loss_type == "vespo":
        keys = ("k_pos", "lambda_pos", "k_neg", "lambda_neg")
        return {
            "surrogate": "vespo",
            "surrogate_params": {k: float(getattr(args, f"vespo_{k}")) for k in keys},
            "aggregation": "token_mean",
            **common,
        }
    raise ValueError(f"GRPOConfig(loss_type={loss_type!r}) is not a TRL 1.16 loss type")


def preset_from_trl_config(args: Any, *, loss: bool = True) -> Preset:
    """The grouprl preset that computes what TRL's ``GRPOTrainer`` computes under ``args``.

    Advantage half from :func:`trl_estimator`, loss half from :func:`trl_loss_half` (skipped
    with ``loss=False``: the ``grpo`` preset's loss half stays, unused), one minibatch and
    epoch per generation batch as the config runs them (:func:`trl_schedule`).
    """
    name, params = trl_estimator(args)
    minibatches, epochs = trl_schedule(args)
    changes: dict[str, Any] = {
        "name": "trl",
        "estimator": name,
        "estimator_params": params,
        "minibatches": minibatches,
        "ppo_epochs": epochs,
    }
    if loss:
        changes.update(trl_loss_half(args))
    return preset_lib.get("grpo").with_(**changes)


def trl_default_values() -> Any:
    """Every ``GRPOConfig`` field at its declared default (the reference of "set by the user").

    Read from the dataclass fields, so no ``TrainingArguments`` is built (that would touch the
    process group); ``epsilon_high`` is None there, read as ``epsilon`` as TRL does.
    """
    import dataclasses
    from types import SimpleNamespace

    from trl import GRPOConfig

    values = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    # GRPOConfig.__post_init__ maps the boolean spellings of scale_rewards
    values["scale_rewards"] = {True: "group", False: "none"}.get(
        values.get("scale_rewards"), values.get("scale_rewards")
    )
    return SimpleNamespace(**values)


def default_trl_config(model: Any) -> Any:
    """The ``GRPOConfig`` TRL 1.16 builds for ``args=None`` (``GRPOTrainer.__init__``)."""
    from trl import GRPOConfig

    if isinstance(model, str):
        name = model
    else:
        from trl.trainer.grpo_trainer import get_config_model_id

        name = get_config_model_id(model.config)
    return GRPOConfig(f"{name.split('/')[-1]}-GRPO")


def changed_values(changes: list[tuple[str, Any, Any]]) -> dict[str, Any]:
    """``{field: new value}`` of :func:`config_changes` rows."""
    return {key: new for key, _, new in changes}


def _config_value(args: Any, key: str) -> Any:
    """A ``GRPOConfig`` field as TRL reads it (``epsilon_high`` None = ``epsilon``)."""
    return trl_epsilon_high(args) if key == "epsilon_high" else getattr(args, key)


def config_changes(
    settings: Mapping[str, Any], args: Any, defaults: Any
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """The ``GRPOConfig`` fields a preset's ``settings`` change, split by who set them.

    Returns ``(changed, overridden)``: each ``(field, value in args, preset's value)``;
    ``overridden`` holds the fields whose value in ``args`` differs from TRL's default (the
    user set them) [OURS: a field left at its default counts as not set].
    """
    changed, overridden = [], []
    for key, value in settings.items():
        have = _config_value(args, key)
        if have == value or (
            isinstance(have, float) and isinstance(value, float) and math.isclose(have, value)
        ):
            continue
        row = (key, have, value)
        changed.append(row)
        if have != _config_value(defaults, key):
            overridden.append(row)
    return changed, overridden


TRL_AGGREGATIONS: dict[str, str] = {
    "sum_then_normalize": "sum",
    "normalize_then_sum": "normalize_then_sum",
}
"""TRL ``multi_objective_aggregation`` -> grouprl reward combination (the same rule)."""


def _check_trl_can_run(spec: Preset) -> None:
    """A clear error for what TRL's trainer cannot feed the preset's advantage half."""
    reads = adv_lib.needs(spec.estimator, **dict(spec.estimator_params))
    if "baseline" in reads:
        raise ValueError(
            f"{spec.estimator!r} needs one greedy completion per prompt as its baseline "
            "(ReMax), which TRL's GRPOTrainer does not generate: use `grouprl train` or verl's "
            "algorithm.adv_estimator=remax"
        )
    if spec.token_level:
        what = (
            f"a KL folded into the reward (reward_kl_coef={spec.reward_kl_coef})"
            if spec.reward_kl_coef > 0
            else f"the token-level estimator {spec.estimator!r}"
        )
        raise ValueError(
            f"preset {spec.name!r} needs per-token advantages for {what}; TRL's GRPOTrainer "
            "trains on one advantage per completion. Use `grouprl train`, or verl "
            "(algorithm.use_kl_in_reward / its optimal_token_baseline)"
        )


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[B]`` rewards as TRL combines them (``sum_then_normalize``): weighted ``nansum``, and
    NaN where every reward function returned None (TRL 1.x ``unscorable_mask``)."""
    w = weights.to(rewards_per_func.device, rewards_per_func.dtype)
    rewards = (rewards_per_func * w[None, :]).nansum(dim=1)  # [B]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)


# --------------------------------------------------------------------------- diagnostics
class GroupRLDiagnosticsCallback(TrainerCallback):
    """Logs grouprl's per-batch diagnostics into TRL's metrics and warns via RunHealth.

    :meth:`observe` (called by :class:`GroupRLGRPOTrainer` once per generation batch) appends
    ``grouprl/<key>`` values to the trainer's metric buffer, which TRL averages over the
    logging window and logs with its own metrics: the :func:`grouprl.diagnostics.step_metrics`
    keys (``acr/*`` split, ``scale/inv_p95`` / ``p99`` tails, ``adv/*``...), the estimator's
    ``stats`` (``grouprl/est/*``), ``health/*`` and the tail-miss risk (``tailmiss/*``,
    F-GRPO Lemma 3.1 with ρ = :data:`TAIL_MISS_RHO`). RunHealth warnings are emitted through
    the ``grouprl.integrations.trl`` logger at the next ``on_log`` and kept in ``warnings``.
    """

    def __init__(self, health: diagnostics.RunHealth | None = None) -> None:
        self.health = health or diagnostics.RunHealth()
        self.warnings: list[str] = []
        self._pending: list[str] = []
        self._trainer: GRPOTrainer | None = None

    def bind(self, trainer: GRPOTrainer) -> None:
        """Attach to the trainer whose metric buffer receives the values."""
        self._trainer = trainer

    def metrics(
        self, rewards: torch.Tensor, adv: Advantages, reward_range: tuple[float, float]
    ) -> dict[str, float]:
        """Diagnostics of one ``[P, G]`` reward batch and its advantages (no side effects)."""
        out = diagnostics.step_metrics(rewards, adv, reward_range=reward_range)
        out.update({f"est/{k}": float(v) for k, v in adv.stats.items()})
        lo, hi = reward_range
        valid = ~torch.isnan(rewards)
        has = valid.any(dim=1)
        if bool(has.any()):
            mean = torch.where(valid, rewards, torch.zeros_like(rewards)).sum(1)
            mu = ((mean[has] / valid[has].sum(1)) - lo) / (hi - lo)  # [P'] success rate
            mu = mu.double().clamp(0.0, 1.0)
            g = rewards.shape[1]
            risk = diagnostics.tail_miss_probability(mu, TAIL_MISS_RHO * mu, g)
            out["tailmiss/risk"] = float(risk.mean())
            out["tailmiss/p_active"] = float(diagnostics.p_active(mu, g).mean())
            advice = diagnostics.advise_group_size(mu.cpu(), TAIL_MISS_RHO)
            out["tailmiss/recommended_group_size"] = float(advice.recommended)
        return out

    def observe(
        self,
        rewards: torch.Tensor,
        adv: Advantages,
        *,
        mode: str = "train",
        reward_range: tuple[float, float] = (0.0, 1.0),
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Compute the diagnostics of one generation batch and push them into TRL's metrics.

        ``extra``: further metrics of the batch (the ``mismatch/*`` of a vLLM run), logged and
        read by the health rules with the others.
        """
        out = self.metrics(rewards, adv, reward_range)
        out.update(extra or {})
        if mode == "train":
            step = self._trainer.state.global_step if self._trainer is not None else 0
            for line in self.health.update(step, out):
                self._pending.append(line)
            out.update(self.health.metrics())
        if self._trainer is not None:
            buffer = self._trainer._metrics[mode]
            for key, value in out.items():
                if value is not None and math.isfinite(value):
                    buffer[f"grouprl/{key}"].append(float(value))
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        for line in self._pending:
            log.warning(line)
            self.warnings.append(line)
        self._pending.clear()
        return control

    def state_dict(self) -> dict[str, Any]:
        return {"health": self.health.state_dict(), "warnings": list(self.warnings)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.health.load_state_dict(dict(state["health"]))
        self.warnings = list(state.get("warnings", []))


# --------------------------------------------------------------------------- the trainer
class GroupRLGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with grouprl's diagnostics, and optionally its methods.

    The constructor takes ``GRPOTrainer``'s arguments, positionally or by keyword
    (``args=None`` builds TRL's default ``GRPOConfig``), plus the keywords below. Three modes:

    - **No** ``preset=`` **/** ``estimator=``: TRL's own advantages and loss under the user's
      ``GRPOConfig``, unchanged, with the ``grouprl/*`` diagnostics, RunHealth warnings and
      ``diagnose``-ready logs added (the estimator's statistics from the grouprl estimator
      that equals TRL's rule, :func:`trl_estimator`).
    - ``estimator=``: grouprl's estimator replaces TRL's advantages; the loss is what the
      ``GRPOConfig`` says.
    - ``preset=``: the preset's advantage half replaces TRL's; its loss half is set on a copy
      of the config (:func:`trl_loss_settings`) or, when TRL cannot express it, computed by
      :func:`grouprl.losses.objective`. Each field it changes is named in one warning with
      both values; a field the user set (not at TRL's default) is refused unless
      ``override_config=True``.

    Args:
        preset: a grouprl preset name (``"f_grpo"``, ``"avspo"``, ``"maxnorm_rloo"``...) or
            :class:`~grouprl.presets.Preset`.
        estimator: instead of a preset, an estimator name.
        advantage_kwargs: overrides of the advantage half (``focal_gamma``, ``delta_res``,
            ``virtual``, estimator parameters such as ``eps``); needs preset= or estimator=.
        loss: ``"auto"`` (TRL's loss when it can express the preset), ``"trl"`` (always
            TRL's; the preset's loss half is only mapped when possible) or ``"grouprl"``
            (grouprl's objective; without a preset it computes the ``GRPOConfig``'s loss,
            :func:`trl_loss_half`).
        reward_range: ``(r_lo, r_hi)`` of the combined reward (focal weight, virtual samples,
            ACR split); default [0, 1].
        diagnostics: add a :class:`GroupRLDiagnosticsCallback` (default True).
        override_config: let a preset change ``GRPOConfig`` fields the user set.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *more: Any,
        preset: str | Preset | None = None,
        estimator: str | None = None,
        advantage_kwargs: Mapping[str, Any] | None = None,
        loss: str = "auto",
        reward_range: tuple[float, float] = (0.0, 1.0),
        diagnostics: bool = True,
        override_config: bool = False,
        **kwargs: Any,
    ) -> None:
        if loss not in ("auto", "trl", "grouprl"):
            raise ValueError(f"loss must be 'auto', 'trl' or 'grouprl', got {loss!r}")
        if preset is not None and estimator is not None:
            raise ValueError(
                "give at most one of preset= (a grouprl preset name, e.g. 'f_grpo') or "
                f"estimator= (one of {', '.join(adv_lib.names())}); neither = TRL's own GRPO"
            )
        if preset is None and estimator is None and advantage_kwargs:
            raise ValueError(
                "advantage_kwargs= changes a grouprl estimator: give estimator= or preset= "
                "with it (without either the trainer computes TRL's own advantages)"
            )
        if args is None:  # TRL's own default (GRPOTrainer.__init__)
            args = default_trl_config(model)
        self.grouprl_mode = "preset" if preset is not None else "estimator" if estimator else "trl"
        if self.grouprl_mode == "trl":
            spec = preset_from_trl_config(args, loss=loss == "grouprl")
        else:
            spec = resolve_preset(preset, estimator, advantage_kwargs)
            if self.grouprl_mode == "estimator" and loss == "grouprl":
                spec = spec.with_(**trl_loss_half(args))  # the config's loss, ours
        self.grouprl_preset = spec
        self.grouprl_advantage_kwargs = spec.advantage_kwargs()
        self.grouprl_reward_range = (float(reward_range[0]), float(reward_range[1]))
        _check_trl_can_run(spec)
        # Validate the advantage half now, not at the first step.
        adv_lib.compute(
            spec.estimator,
            torch.tensor([[0.0, 1.0]]),
            reward_range=self.grouprl_reward_range,
            lengths=torch.ones(1, 2),
            **self.grouprl_advantage_kwargs,
        )
        if spec.controller is not None:
            raise ValueError(
                f"preset {spec.name!r} needs the {spec.controller!r} controller (sampling "
                "temperature / clip control), which the TRL integration does not drive; use "
                "`grouprl train` or a preset without a controller"
            )
        if spec.sampler != "uniform":
            raise ValueError(
                f"preset {spec.name!r} draws prompts with the {spec.sampler!r} sampler "
                "(grouprl.sampling, IS-GRPO), which TRL's dataloader does not do; without it the "
                "preset is plain GRPO. Use `grouprl train`, or preset='grpo' if GRPO is meant"
            )
        self.grouprl_trigger = VirtualTrigger() if spec.virtual is not None else None
        self.grouprl_config_changes: list[tuple[str, Any, Any]] = []
        args, self._grouprl_loss = self._configure_loss(spec, args, loss, override_config)
        self.grouprl_callback = GroupRLDiagnosticsCallback() if diagnostics else None
        self._grouprl_rewards_per_func: torch.Tensor | None = None
        self.grouprl_last: tuple[torch.Tensor, Advantages] | None = None
        super().__init__(model, reward_funcs, args, *more, **kwargs)
        trl_agg = getattr(self.args, "multi_objective_aggregation", "sum_then_normalize")
        ours = self.grouprl_advantage_kwargs.get("combine") or adv_lib.DEFAULT_COMBINATION.get(
            spec.estimator, "sum"
        )
        if TRL_AGGREGATIONS.get(trl_agg) != ours:
            raise ValueError(
                f"GRPOConfig(multi_objective_aggregation={trl_agg!r}) but the grouprl estimator "
                f"{spec.estimator!r} combines the reward functions with {ours!r}: for GDPO use "
                "preset='gdpo' or estimator='gdpo' (TRL's normalize_then_sum), otherwise leave "
                "TRL's default 'sum_then_normalize'"
            )
        if self._grouprl_loss:
            self._check_grouprl_loss_args()
        self.grouprl_schedule_note = (
            schedule_note(spec, self.args) if self.grouprl_mode == "preset" else None
        )
        if self.grouprl_schedule_note:
            log.warning(self.grouprl_schedule_note)
        if self.grouprl_callback is not None:
            self.grouprl_callback.bind(self)
            self.add_callback(self.grouprl_callback)

    # -- construction helpers ----------------------------------------------------------------
    def _configure_loss(
        self, spec: Preset, targs: Any, loss: str, override: bool
    ) -> tuple[Any, bool]:
        """The config to run (a copy when the preset changes it) and whether ours must run.

        A preset's fields are named in one warning (field, the config's value, the preset's);
        fields the user set (off TRL's default) raise unless ``override``.
        """
        from_preset = self.grouprl_mode == "preset"
        use_ours = loss == "grouprl" or (
            loss == "auto" and from_preset and _needs_grouprl_loss(spec)
        )
        settings: dict[str, Any] = {}
        if from_preset:
            settings.update(trl_loss_settings(spec) or {})
            if use_ours:
                settings["beta"] = float(spec.beta)
            settings["use_bias_correction_kl"] = False  # a preset's KL is the plain estimator
            if float(settings.get("beta", getattr(targs, "beta", 0.0))) == 0.0:
                settings.pop("use_bias_correction_kl")  # no KL term: the field is unused
        if self.grouprl_mode != "trl":
            combination = spec.reward_combination or adv_lib.DEFAULT_COMBINATION.get(
                spec.estimator, "sum"
            )
            trl_agg = getattr(targs, "multi_objective_aggregation", "sum_then_normalize")
            if combination == "normalize_then_sum" and trl_agg == "sum_then_normalize":
                # TRL's own name for GDPO's combination, so its logs say what runs
                settings["multi_objective_aggregation"] = "normalize_then_sum"
        changed, overridden = config_changes(settings, targs, trl_default_values())
        who = f"preset {spec.name!r}" if from_preset else f"estimator {spec.estimator!r}"
        if overridden and not override:
            fields = "; ".join(f"{k}: yours {a!r}, the preset's {b!r}" for k, a, b in overridden)
            raise ValueError(
                f"{who} must change GRPOConfig fields you set: {fields}. Pass "
                "override_config=True to let it, drop the fields from your GRPOConfig, or "
                "leave preset= out to train with TRL's own GRPO on your config"
            )
        if changed:
            self.grouprl_config_changes = changed
            log.warning(
                "%s changes the GRPOConfig: %s",
                who,
                ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed),
            )
            targs = copy.copy(targs)  # never mutate the caller's config
            for key, value in changed_values(changed).items():
                setattr(targs, key, value)
        if from_preset and (spec.dynamic_sampling or spec.overlong is not None):
            log.warning(
                "preset %r asks for dynamic sampling / overlong shaping, which the TRL "
                "integration does not apply; set TRL's own options (mask_truncated_completions)",
                spec.name,
            )
        return targs, use_ours

    def _check_grouprl_loss_args(self) -> None:
        unsupported = {
            "entropy bonus": bool(getattr(self, "_entropy_bonus_enabled", False)),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"the grouprl loss path (preset {self.grouprl_preset.name!r}) does not apply "
                f"TRL's {', '.join(bad)}; turn them off or pass loss='trl'"
            )

    # -- advantages ---------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._grouprl_rewards_per_func = rewards_per_func  # [B_all, n_funcs], gathered
        return rewards_per_func

    def grouprl_advantages(
        self,
        rewards: torch.Tensor,
        mode: str = "train",
        lengths: torch.Tensor | None = None,
    ) -> Advantages:
        """grouprl advantages of a ``[P, G]`` (or per-function ``[P, G, K]``, combined with
        TRL's ``reward_weights``) reward batch; advances the trigger in training."""
        kwargs = dict(self.grouprl_advantage_kwargs)
        if self.grouprl_trigger is not None:
            trig = self.grouprl_trigger
            kwargs["trigger"] = trig if mode == "train" else copy.deepcopy(trig)
        if rewards.dim() == 3:
            kwargs["reward_weights"] = self.reward_weights.to(rewards.device, rewards.dtype)
        return adv_lib.compute(
            self.grouprl_preset.estimator,
            rewards,
            reward_range=self.grouprl_reward_range,
            lengths=lengths,
            **kwargs,
        )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        g = self.num_generations if mode == "train" else self.num_generations_eval
        per_func = self._grouprl_rewards_per_func.float()  # [B_all, K]
        rewards = combine_rewards(per_func, self.reward_weights)  # [B_all]
        grid = rewards.view(-1, g)  # [P, G] prompt-major, as TRL groups them
        lengths = None
        if "lengths" in adv_lib.needs(
            self.grouprl_preset.estimator, **self.grouprl_advantage_kwargs
        ):
            local = output["completion_mask"].sum(dim=1)  # [B_local]
            lengths = self.accelerator.gather(local).view(-1, g)  # [P, G], every process's
        out = self.grouprl_advantages(per_func.view(grid.shape[0], g, -1), mode, lengths)
        local = output["advantages"].shape[0]
        if self.grouprl_mode == "trl":
            # TRL's own advantages train; the diagnostics read them (every process's rows)
            # with the scale and statistics of the grouprl estimator that equals TRL's rule
            trl_all = self.accelerator.gather(output["advantages"].detach())  # [B_all]
            values = trl_all.to(out.values.device, out.values.dtype).view_as(out.values)
            out = dataclasses.replace(out, values=values)
        else:
            flat = out.values.reshape(-1)  # [B_all]
            start = self.accelerator.process_index * local
            rows = slice(start, start + local)
            output["advantages"] = flat[rows].to(
                output["advantages"].device, output["advantages"].dtype
            )
            if self._grouprl_loss:
                output["grouprl_keep"] = out.keep.repeat_interleave(g)[rows].to(
                    output["advantages"].device
                )
                kl_weight = out.kl_weight.repeat_interleave(g)[rows]
                output["grouprl_kl_weight"] = kl_weight.to(output["advantages"].device)
            # TRL's completions table shows the advantages trained on.
            logged = self._logs["advantages"]
            for _ in range(min(len(flat), len(logged))):
                logged.pop()
            logged.extend(flat.tolist())
        self.grouprl_last = (grid.detach().cpu(), out)
        if self.grouprl_callback is not None:
            self.grouprl_callback.observe(
                grid,
                out,
                mode=mode,
                reward_range=self.grouprl_reward_range,
                extra=self._grouprl_mismatch(output),
            )
        return output

    @staticmethod
    def _grouprl_mismatch(output: Mapping[str, Any]) -> dict[str, float]:
        """``mismatch/*`` of this process's rows when the rollout engine returned log-probs.

        TRL logs the logp difference and the *truncated* ratio (``sampling/*``); these are
        the raw ratio quantiles, KL, χ² and effective sample size before any correction.
        NaN sampling log-probs (tokens vLLM could not score) are left out, as TRL does.
        """
        sampling, old = output.get("sampling_per_token_logps"), output.get("old_per_token_logps")
        if sampling is None or old is None:
            return {}
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        if not bool(mask.any()):
            return {}
        out = diagnostics.mismatch_metrics(old, sampling, mask, nan_rollout="neutral")
        ratio = output.get("importance_sampling_ratio")  # TRL's applied correction, if on
        if ratio is not None:
            valid = mask.bool()
            applied = ratio.expand_as(mask)[valid].float()
            out["corr/weight_mean"] = float(applied.mean())
            out["corr/zeroed_frac"] = float((applied == 0).float().mean())
        return out

    # -- loss -----------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of the generation batch, then, for grouprl's loss path, each
        micro-batch's optimizer-step token count (see :meth:`_grouprl_window_tokens`)."""
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        aligned = self.args.steps_per_generation % max(1, self.args.gradient_accumulation_steps)
        fresh = self._buffered_inputs is not buffered
        if self._grouprl_loss and self.model.training and fresh and aligned == 0:
            self._grouprl_window_tokens(self._buffered_inputs)
        return inputs

    def _grouprl_window_tokens(self, chunks: list[dict[str, Any]]) -> None:
        """Write into each buffered micro-batch the valid tokens of its optimizer step.

        TRL splits a generation batch into ``steps_per_generation`` micro-batches per process
        and steps the optimizer every ``gradient_accumulation_steps`` of them; its token-mean
        losses (``dapo``, ``cispo``, ``vespo``) divide by the generation batch's tokens per
        window, which equals a step's own tokens only when every window holds as many
        (docs/integrations.md measures the difference). The counts of every micro-batch on
        every process are gathered once per generation batch, so each step divides by its own
        tokens, over all processes: the step's token mean, exact under accumulation. [OURS]
        Only when ``steps_per_generation`` is a multiple of the accumulation steps: otherwise a
        step spans two generation batches, its tokens are not known in advance, and the loss
        keeps TRL's normaliser.
        """
        ga = max(1, int(self.args.gradient_accumulation_steps))

        def valid(chunk: Mapping[str, Any]) -> torch.Tensor:
            mask = chunk["completion_mask"]
            return (mask * chunk["tool_mask"] if "tool_mask" in chunk else mask).sum()

        counts = torch.stack([valid(c) for c in chunks]).float()  # [S] this process's
        every = self.accelerator.gather(counts).view(-1, len(chunks)).sum(0)  # [S] all processes
        for i, chunk in enumerate(chunks):
            window = slice(i - i % ga, i - i % ga + ga)
            chunk["grouprl_step_tokens"] = every[window].sum()

    def _grouprl_totals(self, inputs, mask: torch.Tensor, mode: str) -> loss_lib.StepTotals:
        """The step's normalisers as StepTotals, so the micro-batch losses add up to the loss
        of the step's batch.

        TRL 1.16 ``_compute_loss``: ``grpo`` / ``sapo`` / ``luspo`` / ``dr_grpo`` divide by the
        accumulation steps (``num_seqs`` = rows × steps), ``bnpo`` divides the micro-batch's own
        token mean by the steps (``num_micro``), as TRL does. The token mean (TRL's ``dapo`` /
        ``cispo`` / ``vespo``) divides by the step's own tokens per process
        (:meth:`_grouprl_window_tokens`) where TRL divides by the generation batch's tokens per
        window (``num_items_in_batch`` · steps / ``steps_per_generation``); the two agree when
        ``steps_per_generation`` equals the accumulation steps. No accumulation in eval.
        """
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        n_seq = float(mask.shape[0] * ga)
        tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
        if mode == "train" and "grouprl_step_tokens" in inputs:
            tokens = float(inputs["grouprl_step_tokens"]) / self.accelerator.num_processes
        elif mode == "train":
            tokens = tokens * ga / self.args.steps_per_generation
        return loss_lib.StepTotals(
            num_tokens=max(tokens, 1.0),
            num_seqs=n_seq,
            max_len=float(self.max_completion_length),
            num_micro=int(ga),
        )

    def _grouprl_correction_weight(
        self, inputs, logps: torch.Tensor, old: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """``[B, T]`` factor on our surrogate's per-token loss that TRL's own loss applies.

        TRL 1.16 ``_compute_loss`` multiplies the policy term (not the KL term) by
        DeepSeek-V3.2's off-policy sequence mask (``off_policy_mask_threshold``, computed
        here by TRL's own ``get_off_policy_mask`` on this micro-batch's log-probs) and by the
        vLLM importance-sampling ratio that TRL computed in ``_generate_and_score_completions``
        (``inputs["importance_sampling_ratio"]``: ``[B, T]`` in token modes, ``[B, 1]`` in
        sequence modes; ``vllm_importance_sampling_mode`` and its caps). Zeroed tokens stay in
        the normaliser, as in TRL. None when neither is on.
        """
        weight = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weight = inputs["importance_sampling_ratio"].expand_as(mask).to(logps.dtype)
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get(
                "sampling_per_token_logps", logps.detach() if old is None else old
            )
            opsm = self.get_off_policy_mask(
                advantages=inputs["advantages"].reshape(-1, 1),
                per_token_logps=logps,
                sampling_per_token_logps=sampling,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )  # [B, 1]
            opsm = opsm.expand_as(mask).to(logps.dtype)
            weight = opsm if weight is None else weight * opsm
        return None if weight is None else weight.detach()

    def _grouprl_level(self) -> str:
        """``"sequence"`` when the surrogate's ratio is GSPO's sequence ratio, else ``"token"``."""
        spec = self.grouprl_preset
        if spec.surrogate == "gspo" or dict(spec.surrogate_params).get("level") == "sequence":
            return "sequence"
        return "token"

    def _grouprl_log_trl_metrics(
        self,
        mode: str,
        inputs,
        logps: torch.Tensor,
        old: torch.Tensor,
        mask: torch.Tensor,
        entropies: torch.Tensor,
        stats: Mapping[str, Any],
    ) -> None:
        """TRL 1.16's own loss metrics (``_compute_loss``, "Log the metrics"), on our path.

        ``entropy`` and ``kl`` (the preset's KL estimate, times the ratio under
        ``use_bias_correction_kl``, as TRL logs it) as masked means over every process; for a
        clipped surrogate ``clip_ratio/{low,high,region}_mean``, ``low_min``, ``high_max`` with
        TRL's definitions (ratio beyond the bound on the side where the advantage sign makes
        the clip bind); ``cispo_clip_ratio`` for CISPO; ``vespo/phi_seq_mean`` for VESPO.
        The collectives run on every process, also for an all-masked micro-batch.
        """
        from trl.trainer.utils import nanmax, nanmin

        spec = self.grouprl_preset
        params = dict(spec.surrogate_params)
        m = self._metrics[mode]
        adv = inputs["advantages"].reshape(-1, 1).to(logps.dtype)  # [B, 1]
        mask_f = mask.to(logps.dtype)
        log_ratio = (logps - old).detach()
        if self._grouprl_level() == "sequence":
            seq = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)
            coef_1 = seq.exp().unsqueeze(-1)  # [B, 1]
        else:
            coef_1 = log_ratio.exp()  # [B, T]

        def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] == 1:
                return x.squeeze(1)
            return (x * mask_f).sum(-1) / mask_f.sum(-1)

        def global_masked_mean(x: torch.Tensor) -> float:
            if x.shape[1] == 1:
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask_f).sum(), mask_f.sum()])
            totals = self.accelerator.reduce(local.float(), reduction="sum")
            return float(totals[0] / totals[1].clamp(min=1.0))

        if self.beta != 0.0:
            per_token_kl = loss_lib.kl(spec.kl, logps.detach(), inputs["ref_per_token_logps"])
            if getattr(self.args, "use_bias_correction_kl", False):
                per_token_kl = per_token_kl * coef_1
            m["kl"].append(global_masked_mean(per_token_kl.detach()))
        m["entropy"].append(global_masked_mean(entropies.detach()))
        if spec.surrogate in ("ppo_clip", "gspo") and "eps_low" in params:
            low = (coef_1 < 1 - float(params["eps_low"])) & (adv < 0)
            high = (coef_1 > 1 + float(params.get("eps_high", params["eps_low"]))) & (adv > 0)
            m["clip_ratio/low_mean"].append(global_masked_mean(low.to(logps.dtype)))
            m["clip_ratio/high_mean"].append(global_masked_mean(high.to(logps.dtype)))
            m["clip_ratio/region_mean"].append(global_masked_mean((low | high).to(logps.dtype)))
            gathered_low = self.accelerator.gather(masked_seq_mean(low.to(logps.dtype)))
            m["clip_ratio/low_min"].append(nanmin(gathered_low).item())
            gathered_high = self.accelerator.gather(masked_seq_mean(high.to(logps.dtype)))
            m["clip_ratio/high_max"].append(nanmax(gathered_high).item())
        elif spec.surrogate == "cispo":
            clipped = (coef_1 > 1 + float(params.get("eps_high", 5.0))) & (adv > 0)
            m["cispo_clip_ratio"].append(global_masked_mean(clipped.to(logps.dtype)))
        elif spec.surrogate == "vespo":
            keys = ("k_pos", "lambda_pos", "k_neg", "lambda_neg")
            phi = self.get_gamma_weights(
                advantages=adv,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                **{k: float(params[k]) for k in keys if k in params},
            )
            m["vespo/phi_seq_mean"].append(global_masked_mean(phi))
        else:  # surrogates TRL does not have: their own clip fractions, this process's
            for ours, theirs in (
                ("clip_frac_low", "clip_ratio/low_mean"),
                ("clip_frac_high", "clip_ratio/high_mean"),
                ("clip_frac_region", "clip_ratio/region_mean"),
            ):
                if ours in stats:
                    m[theirs].append(float(stats[ours]))

    def _compute_loss(self, model, inputs):
        if not self._grouprl_loss:
            return super()._compute_loss(model, inputs)
        spec = self.grouprl_preset
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        aux_enabled = bool(getattr(self, "aux_loss_enabled", False))
        forward = {
            key: inputs.get(key)
            for key in (
                "pixel_values",
                "image_grid_thw",
                "num_images",
                "pixel_attention_mask",
                "spatial_shapes",
                "num_tiles",
                "image_sizes",
                "token_type_ids",
                "mm_token_type_ids",
                "image_position_ids",
            )
            if inputs.get(key) is not None
        }
        if aux_enabled:
            forward["compute_aux_loss"] = True
        # TRL 1.0 returns (logps, entropies); later 1.x add the router aux loss
        got = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            **forward,
        )
        logps, entropies = got[0], got[1]
        aux_loss = got[2] if aux_enabled else None
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        mode = "train" if self.model.training else "eval"
        kl_correction = None
        if getattr(self.args, "use_bias_correction_kl", False):  # TRL >= 1.x
            sequence = self._grouprl_level() == "sequence"
            kl_correction = "sequence_ratio" if sequence else "ratio"
        weight = self._grouprl_correction_weight(inputs, logps, old, mask)
        stats: dict[str, Any] = {}
        if bool(mask.any()):
            out = loss_lib.objective(
                logps,
                old,
                inputs["advantages"],
                mask,
                surrogate=spec.surrogate,
                surrogate_params=dict(spec.surrogate_params),
                aggregation=spec.aggregation,
                totals=self._grouprl_totals(inputs, mask, mode),
                keep=inputs.get("grouprl_keep"),
                ref_logp=inputs.get("ref_per_token_logps"),
                kl=spec.kl,
                beta=float(self.beta),
                kl_weight=inputs.get("grouprl_kl_weight"),
                entropy=entropies,
                kl_correction=kl_correction,
                top_entropy_quantile=float(self.top_entropy_quantile),
                correction_weight=weight,
            )
            loss, stats = out.loss, out.stats
        else:  # every completion token masked: TRL's loss is 0 (0 / clamp(0, 1)), and so is ours
            loss = (logps * 0.0).sum()
        if aux_loss is not None:  # TRL: the router loss, scaled for accumulation, and logged
            ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / ga
            aux = self.accelerator.gather_for_metrics(aux_loss.detach())
            self._metrics[mode]["aux_loss"].append(aux.mean().item())
        self._grouprl_log_trl_metrics(mode, inputs, logps, old, mask, entropies, stats)
        m = self._metrics[mode]
        for key in ("pg_loss", "kl_loss", "kept_frac", "ratio_mean", "approx_kl"):
            if key in stats:
                m[f"grouprl/loss/{key}"].append(float(stats[key]))
        return loss

    # -- checkpoints ----------------------------------------------------------------------------
    def grouprl_state_dict(self) -> dict[str, Any]:
        """The AVSPO trigger and the RunHealth state (written to each checkpoint)."""
        return {
            "trigger": None if self.grouprl_trigger is None else self.grouprl_trigger.state_dict(),
            "callback": None
            if self.grouprl_callback is None
            else self.grouprl_callback.state_dict(),
        }

    def grouprl_load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("trigger") is not None and self.grouprl_trigger is not None:
            self.grouprl_trigger.load_state_dict(dict(state["trigger"]))
        if state.get("callback") is not None and self.grouprl_callback is not None:
            self.grouprl_callback.load_state_dict(state["callback"])

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            path = os.path.join(self._get_output_dir(trial=trial), folder, STATE_FILE)
            with open(path, "w") as f:
                json.dump(self.grouprl_state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            path = os.path.join(checkpoint, STATE_FILE)
            if os.path.exists(path):
                with open(path) as f:
                    self.grouprl_load_state_dict(json.load(f))
