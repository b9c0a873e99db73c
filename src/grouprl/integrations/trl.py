"""grouprl's advantages (and, where a preset needs it, loss) inside TRL's GRPOTrainer (TRL 1.x).

    from grouprl.integrations.trl import GroupRLGRPOTrainer
    trainer = GroupRLGRPOTrainer(preset="maxnorm_rloo", model=..., reward_funcs=...,
                                 args=GRPOConfig(...), train_dataset=...)
    trainer.train()

What changes against a plain ``GRPOTrainer`` (the least invasive overrides TRL 1.x allows;
TRL has no advantage hook):

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
  (:func:`trl_loss_settings`: ``loss_type``, ``epsilon``, ``epsilon_high``,
  ``importance_sampling_level``); otherwise (``reinforce``, a dual clip, a k1/k2 KL, a
  per-group KL weight or group skip with β > 0) ``_compute_loss`` computes
  :func:`grouprl.losses.objective` with TRL's log-probabilities and TRL's normalisers, and
  with TRL's rollout corrections (the vLLM importance-sampling ratio of
  ``vllm_importance_sampling_mode`` and DeepSeek-V3.2's ``off_policy_mask_threshold``) as its
  ``correction_weight``, exactly as TRL's own loss applies them.
- :class:`GroupRLDiagnosticsCallback` adds ``grouprl/*`` metrics (ACR split, inverse-scale
  tails, tail-miss risk, estimator stats; with vLLM log-probs the ``mismatch/*`` metrics of
  :func:`grouprl.diagnostics.mismatch_metrics`, raw ratio quantiles included) to TRL's metric
  buffer, so they are averaged and logged next to TRL's own (``reward``, ``kl``,
  ``entropy``, ``clip_ratio/*``, ``sampling/*``...), and turns them into
  :class:`grouprl.diagnostics.RunHealth` warnings.
"""

from __future__ import annotations

import copy
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
}
"""Our aggregation -> TRL ``loss_type`` with the same normaliser (TRL 1.x ``_compute_loss``:
``grpo`` per-sequence token mean, ``dapo`` token mean over the optimizer step, ``dr_grpo``
sum / (B · max_completion_length))."""

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


def trl_loss_settings(preset: Preset) -> dict[str, Any] | None:
    """``GRPOConfig`` fields that make TRL's own loss compute ``preset``'s loss half, or None.

    None when TRL 1.x cannot express it: the ``reinforce`` surrogate, a dual clip
    (``clip_ratio_c``), a KL other than TRL's k3 with β > 0, an aggregation TRL lacks, CISPO
    with a lower weight bound (TRL clips the weight from above only) or CISPO without the
    token mean. GSPO maps to ``importance_sampling_level="sequence"`` (TRL does not clamp
    log s at 10 as verl and we do; identical below that).
    """
    loss_type = TRL_LOSS_TYPES.get(preset.aggregation)
    params = dict(preset.surrogate_params)
    if loss_type is None or (preset.beta > 0 and preset.kl != "k3"):
        return None
    if preset.surrogate in ("ppo_clip", "gspo"):
        if params.get("clip_ratio_c") is not None:
            return None
        level = "sequence" if preset.surrogate == "gspo" else "token"
        defaults = (3e-4, 4e-4) if preset.surrogate == "gspo" else (0.2, 0.2)
        return {
            "loss_type": loss_type,
            "epsilon": float(params.get("eps_low", defaults[0])),
            "epsilon_high": float(params.get("eps_high", defaults[1])),
            "importance_sampling_level": level,
            "beta": float(preset.beta),
        }
    if preset.surrogate == "cispo":
        if loss_type != "dapo" or float(params.get("eps_low", 1.0)) < 1.0:
            return None
        return {
            "loss_type": "cispo",
            "epsilon": 0.2,
            "epsilon_high": 1.0 + float(params.get("eps_high", 5.0)),
            "importance_sampling_level": "token",
            "beta": float(preset.beta),
        }
    return None


def _needs_grouprl_loss(preset: Preset) -> bool:
    """True when TRL's loss cannot reproduce the preset (see :func:`trl_loss_settings`)."""
    if trl_loss_settings(preset) is None:
        return True
    # A per-group KL weight or a skipped group must reach the KL branch too.
    return preset.beta > 0 and (
        preset.estimator == "grpo_beta_comp" or preset.delta_res is not None
    )


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
    """TRL's ``GRPOTrainer`` training on grouprl advantages (and, where needed, loss).

    Args:
        preset: a grouprl preset name (``"f_grpo"``, ``"avspo"``, ``"maxnorm_rloo"``...) or
            :class:`~grouprl.presets.Preset`. Its advantage half replaces TRL's advantage
            step; its loss half is set on TRL's config (:func:`trl_loss_settings`) or, when
            TRL cannot express it, computed by :func:`grouprl.losses.objective`.
        estimator: instead of a preset, an estimator name; the loss stays what ``args`` say.
        advantage_kwargs: overrides of the advantage half (``focal_gamma``, ``delta_res``,
            ``virtual``, estimator parameters such as ``eps``).
        loss: ``"auto"`` (TRL's loss when it can express the preset), ``"trl"`` (always
            TRL's; the preset's loss half is only mapped when possible) or ``"grouprl"``.
        reward_range: ``(r_lo, r_hi)`` of the combined reward (focal weight, virtual samples,
            ACR split); default [0, 1].
        diagnostics: add a :class:`GroupRLDiagnosticsCallback` (default True).
        *args, **kwargs: ``GRPOTrainer``'s own (model, reward_funcs, args, train_dataset...).
    """

    def __init__(
        self,
        *args: Any,
        preset: str | Preset | None = None,
        estimator: str | None = None,
        advantage_kwargs: Mapping[str, Any] | None = None,
        loss: str = "auto",
        reward_range: tuple[float, float] = (0.0, 1.0),
        diagnostics: bool = True,
        **kwargs: Any,
    ) -> None:
        if loss not in ("auto", "trl", "grouprl"):
            raise ValueError(f"loss must be 'auto', 'trl' or 'grouprl', got {loss!r}")
        spec = resolve_preset(preset, estimator, advantage_kwargs)
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
        targs = kwargs.get("args", args[2] if len(args) > 2 else None)
        self._grouprl_loss = self._configure_loss(spec, targs, loss, preset is not None, kwargs)
        self.grouprl_callback = GroupRLDiagnosticsCallback() if diagnostics else None
        self._grouprl_rewards_per_func: torch.Tensor | None = None
        self.grouprl_last: tuple[torch.Tensor, Advantages] | None = None
        super().__init__(*args, **kwargs)
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
        self.grouprl_schedule_note = schedule_note(spec, self.args) if preset is not None else None
        if self.grouprl_schedule_note:
            log.warning(self.grouprl_schedule_note)
        if self.grouprl_callback is not None:
            self.grouprl_callback.bind(self)
            self.add_callback(self.grouprl_callback)

    # -- construction helpers ----------------------------------------------------------------
    @staticmethod
    def _configure_loss(
        spec: Preset, targs: Any, loss: str, from_preset: bool, kwargs: dict[str, Any]
    ) -> bool:
        """Map the preset's loss half onto a copy of ``args``; True when ours must run."""
        if targs is None:
            raise ValueError("GroupRLGRPOTrainer needs args=GRPOConfig(...)")
        use_ours = loss == "grouprl" or (
            loss == "auto" and from_preset and _needs_grouprl_loss(spec)
        )
        settings = trl_loss_settings(spec) if from_preset else None
        if use_ours and spec.beta > 0 and targs.beta == 0.0:
            settings = {**(settings or {}), "beta": float(spec.beta)}
        combination = spec.reward_combination or adv_lib.DEFAULT_COMBINATION.get(
            spec.estimator, "sum"
        )
        trl_agg = getattr(targs, "multi_objective_aggregation", "sum_then_normalize")
        if combination == "normalize_then_sum" and trl_agg == "sum_then_normalize":
            # TRL's own name for GDPO's combination, so its logs and metrics say what runs
            settings = {**(settings or {}), "multi_objective_aggregation": "normalize_then_sum"}
        if settings:
            if "beta" in settings and targs.beta != settings["beta"]:
                log.warning(
                    "preset %r sets beta=%g (your GRPOConfig had %g); pass "
                    "preset=presets.get(%r).with_(beta=...) to change it",
                    spec.name,
                    settings["beta"],
                    targs.beta,
                    spec.name,
                )
            targs = copy.copy(targs)  # never mutate the caller's config
            for key, value in settings.items():
                setattr(targs, key, value)
            if "args" in kwargs:
                kwargs["args"] = targs
            else:  # positional: (model, reward_funcs, args, ...)
                raise ValueError("pass the GRPOConfig as args=..., not positionally")
        if from_preset and (spec.dynamic_sampling or spec.overlong is not None):
            log.warning(
                "preset %r asks for dynamic sampling / overlong shaping, which the TRL "
                "integration does not apply; set TRL's own options (mask_truncated_completions)",
                spec.name,
            )
        return use_ours

    def _check_grouprl_loss_args(self) -> None:
        unsupported = {
            "top_entropy_quantile < 1": self.top_entropy_quantile < 1.0,
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
        flat = out.values.reshape(-1)  # [B_all]
        local = output["advantages"].shape[0]
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
    def _grouprl_totals(self, inputs, mask: torch.Tensor, mode: str) -> loss_lib.StepTotals:
        """TRL's own normalisers as StepTotals, so the micro-batch losses add up as TRL's do."""
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        n_seq = float(mask.shape[0] * ga)
        tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
        if mode == "train":
            tokens = tokens * ga / self.args.steps_per_generation
        return loss_lib.StepTotals(
            num_tokens=max(tokens, 1.0), num_seqs=n_seq, max_len=float(self.max_completion_length)
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
        # TRL 1.0 returns (logps, entropies); later 1.x add the router aux loss
        logps, entropies = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )[:2]
        old = inputs.get("old_per_token_logps")
        mode = "train" if self.model.training else "eval"
        weight = self._grouprl_correction_weight(inputs, logps, old, mask)
        out = loss_lib.objective(
            logps,
            logps.detach() if old is None else old,
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
            correction_weight=weight,
        )
        m = self._metrics[mode]
        m["entropy"].append(out.stats["entropy_mean"])
        if self.beta != 0.0:
            m["kl"].append(out.stats["kl_mean"])
        for ours, theirs in (
            ("clip_frac_low", "clip_ratio/low_mean"),
            ("clip_frac_high", "clip_ratio/high_mean"),
            ("clip_frac_region", "clip_ratio/region_mean"),
        ):
            if ours in out.stats:
                m[theirs].append(out.stats[ours])
        for key in ("pg_loss", "kl_loss", "kept_frac", "ratio_mean", "approx_kl"):
            if key in out.stats:
                m[f"grouprl/loss/{key}"].append(out.stats[key])
        return out.loss

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
