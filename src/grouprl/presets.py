"""The names users know (grpo, dapo, f_grpo, maxnorm_rloo, ...) as frozen combinations of axes.

A preset fixes one choice per axis: estimator (+ its parameters), transforms (resolution,
virtual samples, focal weight), surrogate (+ clip bounds), aggregation, KL estimator and β,
batch filters, and the update schedule its sources run (minibatches per generation batch ×
epochs: with one of each every optimizer step sees ratio 1 and no clip ever acts).
``sources`` cites, per parameter, where its value comes from (ALGORITHMS.md §3). Users
override any field with ``dataclasses.replace`` or from the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "BASELINE_SUFFIX",
    "DEFAULT",
    "PRESETS",
    "Preset",
    "baseline_of",
    "check",
    "frozen",
    "get",
    "names",
    "register_preset",
]

DEFAULT = "grpo"
"""The preset a run takes when none is named."""


def frozen(d: Any = None) -> MappingProxyType:
    """A read-only copy of a mapping (``{}`` for None): the dict fields of frozen configs."""
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Preset:
    """One frozen combination of every axis. Field defaults are GRPO's (verl / TRL).

    Advantage half: ``estimator`` (+ ``estimator_params``), ``focal_gamma`` (0 = off),
    ``delta_res`` (resolution protocol, None = off), ``virtual`` (AVSPO mode, None = off),
    ``transforms`` (registered transforms and their settings, ``{name: {setting: value}}``,
    ``advantages.register_transform``; empty = none).
    Reward side: ``reward_combination`` of several reward functions (None: the estimator's
    default, ``advantages.DEFAULT_COMBINATION``) and a KL folded into the reward
    (``reward_kl_coef`` > 0: ``reward_kl`` estimator, ``reward_kl_controller`` "fixed" or
    "adaptive" with ``reward_kl_target`` / ``reward_kl_horizon``; verl ``use_kl_in_reward``).
    Loss half: ``surrogate`` (+ ``surrogate_params``: clip bounds...), ``aggregation``,
    ``kl`` estimator and ``beta`` (0 = no KL term), batch filters ``dynamic_sampling`` and
    ``overlong`` (None | "mask" | "soft"), and ``controller`` (None | "agpo").
    Prompt half: ``sampler``, a name in :data:`grouprl.sampling.SAMPLERS` ("uniform" | "sigma" | "curriculum");
    ``pool_size`` (0 = the task's fresh stream, > 0 = that many train prompts drawn once, which
    the sampler draws from; ``sampling.pool_size`` overrides it); ``sampler_weight`` (multiply
    each group's advantages by the importance weight 1/(|pool|·p_x) of its draw).
    Update schedule: ``minibatches`` (optimizer steps per epoch over one generation batch, each
    on whole groups) and ``ppo_epochs`` (passes over the batch); the trainer runs them unless
    ``optim.minibatches`` / ``optim.ppo_epochs`` are set (ALGORITHMS.md §3 "Update schedule").
    Rollout correction: ``rollout_correction``, a :func:`grouprl.losses.correction.parse_spec`
    string (``"none"``, ``"icepop"``, ``"seq_tis:cap=2+geo_rs"``) applied when the rollouts'
    log-probs differ from the trainer's (``model.rollout_precision``; ALGORITHMS.md §3c).
    ``sources`` cites, for every one of these fields, where its value comes from.
    """

    name: str
    description: str
    # -- advantage half (ALGORITHMS.md §1-§2)
    estimator: str = "grpo"
    estimator_params: MappingProxyType = field(default_factory=frozen)
    focal_gamma: float = 0.0
    delta_res: float | None = None
    virtual: str | None = None
    virtual_batch_groups: int | None = None
    transforms: MappingProxyType = field(default_factory=frozen)
    # -- reward side (ALGORITHMS.md §1 "Reward combination", §4 "KL in the reward")
    reward_combination: str | None = None  # None: the estimator's default (advantages.compute)
    reward_kl_coef: float = 0.0  # β of a KL folded into the reward (0 = off)
    reward_kl: str = "k1"
    reward_kl_controller: str = "fixed"  # grouprl.control.KL_CONTROLLERS
    reward_kl_target: float = 0.1
    reward_kl_horizon: int = 10000
    # -- loss half (ALGORITHMS.md §3)
    surrogate: str = "ppo_clip"
    surrogate_params: MappingProxyType = field(
        default_factory=lambda: frozen({"eps_low": 0.2, "eps_high": 0.2})
    )
    aggregation: str = "seq_mean_token_mean"
    kl: str = "k3"
    beta: float = 0.0
    dynamic_sampling: bool = False
    overlong: str | None = None  # None | "mask" | "soft"
    controller: str | None = None  # None | "agpo"
    # -- prompt sampler (grouprl.sampling; ALGORITHMS.md §1, IS-GRPO)
    sampler: str = "uniform"
    pool_size: int = 0
    sampler_weight: bool = False
    # -- update schedule (ALGORITHMS.md §3): minibatches × ppo_epochs optimizer steps per batch
    minibatches: int = 1
    ppo_epochs: int = 1
    # -- rollout correction (grouprl.losses.correction; ALGORITHMS.md §3c): a spec string
    rollout_correction: str = "none"
    sources: MappingProxyType = field(default_factory=frozen)

    def __post_init__(self) -> None:
        from grouprl.losses import correction  # validates the spec: unknown names, bad caps

        correction.check_spec(self.rollout_correction)
        if (
            isinstance(self.pool_size, bool)
            or not isinstance(self.pool_size, int)
            or (self.pool_size < 0)
        ):
            raise ValueError(
                f"preset {self.name!r}: pool_size must be an integer >= 0 (0 = a fresh prompt "
                f"stream), got {self.pool_size!r}"
            )
        for key in ("minibatches", "ppo_epochs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"preset {self.name!r}: {key} must be an integer >= 1 (optimizer steps per "
                    f"generation batch = minibatches × ppo_epochs), got {value!r}"
                )
        self._check_reward_side()

    def _check_reward_side(self) -> None:
        """The reward-side fields name things that exist (a clear error, listing them)."""
        from grouprl.advantages import DEFAULT_COMBINATION, REWARD_COMBINATIONS
        from grouprl.control import KL_CONTROLLERS
        from grouprl.losses import KL_ESTIMATORS

        checks = (
            ("reward_combination", self.reward_combination, (None, *REWARD_COMBINATIONS)),
            ("reward_kl", self.reward_kl, tuple(KL_ESTIMATORS)),
            ("reward_kl_controller", self.reward_kl_controller, tuple(KL_CONTROLLERS)),
        )
        for key, value, valid in checks:
            if value not in valid:
                names = ", ".join(str(v) for v in valid)
                raise ValueError(f"preset {self.name!r}: unknown {key} {value!r}; valid: {names}")
        coef = self.reward_kl_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(f"preset {self.name!r}: reward_kl_coef must be >= 0, got {coef!r}")
        how = self.reward_combination or DEFAULT_COMBINATION.get(self.estimator, "sum")
        if how != "sum" and self.overlong == "soft":
            raise ValueError(
                f"preset {self.name!r}: DAPO's soft overlong penalty changes the summed reward, "
                f"which the {how!r} combination does not read; use overlong='mask' [OURS]"
            )

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per generation batch: ``minibatches × ppo_epochs``."""
        return self.minibatches * self.ppo_epochs

    def advantage_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``advantages.compute(self.estimator, rewards, **kwargs)``."""
        kwargs: dict[str, Any] = dict(self.estimator_params)
        if self.focal_gamma:
            kwargs["focal_gamma"] = self.focal_gamma
        if self.delta_res is not None:
            kwargs["delta_res"] = self.delta_res
        if self.virtual is not None:
            kwargs["virtual"] = self.virtual
        if self.virtual_batch_groups is not None:
            kwargs["virtual_batch_groups"] = self.virtual_batch_groups
        if self.reward_combination is not None:
            kwargs["combine"] = self.reward_combination
        if self.transforms:
            kwargs["transforms"] = {k: dict(v or {}) for k, v in self.transforms.items()}
        return kwargs

    @property
    def token_level(self) -> bool:
        """True when the advantages are per token (``advantages.compute_tokens``): a
        token-only estimator, or a KL folded into the reward."""
        from grouprl.advantages import ESTIMATORS

        return self.estimator not in ESTIMATORS or self.reward_kl_coef > 0

    def kl_controller(self):
        """A fresh controller of the reward KL's coefficient (None when the KL is off)."""
        if self.reward_kl_coef <= 0:
            return None
        from grouprl.control import make_kl_controller

        if self.reward_kl_controller == "fixed":
            return make_kl_controller("fixed", coef=self.reward_kl_coef)
        return make_kl_controller(
            self.reward_kl_controller,
            coef=self.reward_kl_coef,
            target=self.reward_kl_target,
            horizon=self.reward_kl_horizon,
        )

    @property
    def reads(self) -> frozenset[str]:
        """What this preset's methods read beyond the rewards (names of
        ``grouprl.registry.INPUTS``), from their declarations: the estimator's, the reward
        combination's, the transforms', the surrogate's and the rollout corrections'; the
        prompt sampler's importance weights when ``sampler_weight``."""
        from grouprl import advantages, losses
        from grouprl.losses import correction

        out = set(advantages.needs(self.estimator, **dict(self.estimator_params))) - {"tokens"}
        out |= advantages.combination_axis.reads(self.combination)
        if self.virtual is not None:
            out |= advantages.transform_axis.reads("virtual")
        if self.focal_gamma:
            out |= advantages.transform_axis.reads("focal_gamma")
        for name in self.transforms:
            out |= advantages.transform_axis.reads(name)
        if self.sampler_weight:
            out.add("draw_weights")
        out |= losses.surrogate_axis.reads(self.surrogate)
        for name, _ in correction.parse_spec(self.rollout_correction):
            out |= losses.correction_axis.reads(name)
        return frozenset(out)

    @property
    def combination(self) -> str:
        """The reward combination the estimator applies (``advantages.compute``)."""
        from grouprl.advantages import DEFAULT_COMBINATION

        return self.reward_combination or DEFAULT_COMBINATION.get(self.estimator, "sum")

    def with_(self, **changes: Any) -> Preset:
        """A copy with some fields changed (dict fields are re-frozen)."""
        for key in ("estimator_params", "surrogate_params", "sources"):
            if key in changes and not isinstance(changes[key], MappingProxyType):
                changes[key] = frozen(changes[key])
        if "transforms" in changes:
            changes["transforms"] = _frozen_transforms(changes["transforms"])
        return replace(self, **changes)


def _frozen_transforms(transforms: Any) -> MappingProxyType:
    """``{name: {setting: value}}`` read-only at both levels (a preset is frozen)."""
    return frozen({k: frozen(v) for k, v in dict(transforms or {}).items()})


_GRPO_CLIP = {"eps_low": 0.2, "eps_high": 0.2}
_DAPO_CLIP = {"eps_low": 0.2, "eps_high": 0.28}
_CISPO_CLIP = {"eps_low": 1.0, "eps_high": 5.0}
_GSPO_CLIP = {"eps_low": 3e-4, "eps_high": 4e-4}

_SAPO_TAU = {"tau_pos": 1.0, "tau_neg": 1.05}
_GMPO_CLIP = {"eps_low": 0.4, "eps_high": 0.4}
_VESPO_PARAMS = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
_S_SAPO_TAU = (
    "SAPO paper: tau_pos 1.0, tau_neg 1.05 (verl ActorConfig.tau_pos/tau_neg, TRL "
    "sapo_temperature_pos/neg defaults)"
)
_S_SAPO_AGG = (
    "seq-mean-token-mean: verl compute_policy_loss_sapo forces it; TRL's sapo normalises as grpo"
)
_S_SAPO_MB = (
    "4 [OURS]: the gate only acts off the behaviour policy, and the SAPO text we could read "
    "does not give its schedule; GSPO's (the same team's baseline): §5.1, four minibatches"
)
_S_GMPO_SH = "GMPO authors' scripts/qwen2.5-math-7b-gmpo.sh"
_S_GMPO_MB = (
    f"8: {_S_GMPO_SH}:54,59,61: rollout_batch_size 128 prompts x num_samples 8 = 1,024 samples, "
    "train_batch_size 128 per optimizer step [OURS: oat's train_batch_size read as samples]"
)
_S_OFF_POLICY_MB = (
    "4 [OURS]: {method}'s weight only acts off the behaviour policy; schedule not given in "
    "the sources we could read; GSPO's four minibatches (§5.1)"
)
_S_GRPO_CLIP = "GRPO / PPO clip 0.2/0.2 (DeepSeekMath; verl clip_ratio, TRL epsilon default)"
_S_DAPO = "DAPO (Yu et al. 2025)"
_S_DAPO_CLIP = "DAPO clip-higher: eps_low 0.2, eps_high 0.28"
_S_TOKEN_MEAN = "token mean over the step (DAPO; verl token-mean; ALGORITHMS.md §3 table)"
_S_CISPO = "CISPO (MiniMax-M1): clipped stop-gradient IS weight on every token"
_S_CISPO_CLIP = "eps 1.0/5.0 (weight in [0, 6]) as F-GRPO and ScaleRL use"
_S_FOCAL = (
    "F-GRPO eqs. 11-13: focal weight (1 - mu)^gamma, mu = X/N the share of correct rollouts; "
    "gamma 0.5 (Table 7: 0.5 in 7 of its 9 model x method set-ups, 1.0 in the others)"
)
_S_FOCAL_BETA = "0.0: F-GRPO App. L.2 drops the KL term (following DAPO) for every method"
_S_MAXNORM = "MaxNorm-AC seed paper: s_q = max(tau_res, max_j |u_j|), |A| <= 1, c carries no grad"
_S_RES = "MaxNorm-AC resolution protocol: delta_res 1e-2 for rewards in [0, 1]"
_S_KL_UNSCALED = "MaxNorm-AC: KL added as beta·KL, never divided by s_q (kl_weight 1)"

# Update schedules: optimizer steps per generation batch = minibatches × ppo_epochs.
_S_GRPO_SCHEDULE = (
    "1 (on-policy): DeepSeekMath §4.2 'The policy model only has a single update following "
    "each exploration stage'; TRL GRPOConfig num_iterations=1, steps_per_generation="
    "gradient_accumulation_steps (verl's GRPO examples use 4: train_batch_size 1024 / "
    "ppo_mini_batch_size 256, examples/grpo_trainer/run_qwen2-7b_math.sh:16,24)"
)
_S_DAPO_MB = (
    "16: DAPO recipe (verl 246cac4 recipe/dapo/run_dapo_qwen2.5_32b.sh:28,31: "
    "train_prompt_bsz 512 / train_prompt_mini_bsz 32); DAPO §4.1: 16 gradient updates per "
    "rollout step"
)
_S_ONE_EPOCH = "1: verl actor ppo_epochs default (verl/trainer/config/actor/actor.yaml:111)"
_S_CISPO_MB = (
    "16: MiniMax-M1 §3.1 'our setup, which involved 16 rounds of off-policy updates per "
    "generation batch'; [OURS] read as 16 minibatches × 1 epoch (the paper does not split them)"
)
_S_GSPO_MB = (
    "4: GSPO §5.1 'each batch of rollout data is partitioned into four minibatches' (verl "
    "examples/gspo_trainer/test_gspo_3b_math.sh:74-75: 512 / 128)"
)
_S_AGPO_EPOCHS = (
    "4: AGPO code, agpo_update_epochs default (wandugu/paper_agpo src/llamafactory/hparams/"
    "finetuning_args.py:231-234); each epoch is one optimizer step over all the step's rollouts "
    "(src/llamafactory/train/agpo/trainer.py:538-554). Its example configs set 1 "
    "(examples/train_lora/qwen3_0_6b_gsm8k_agpo_wandb.yaml:18)"
)
_S_AGPO_MB = (
    "1: AGPO code, one backward over every rollout of the step, then one optimizer step "
    "(src/llamafactory/train/agpo/trainer.py:544-552)"
)
_S_FOCAL_MB = (
    "4: F-GRPO (arXiv 2602.06717v2) App. L.2, Table 5: global batch 256, mini-batch 64, the "
    "same for its GRPO, DAPO and CISPO runs (its maze runs, App. K, take one on-policy update "
    "per step)"
)
_S_FOCAL_EPOCHS = "1: F-GRPO App. L.2, Table 5: PPO epochs 1"
_S_FOCAL_AGG = (
    "token mean: F-GRPO App. L.2 'use token-mean loss aggregation' for every method, its GRPO, "
    "DAPO and CISPO baselines included"
)
_S_FDAPO_NO_DS = (
    "off: F-GRPO App. B describes its DAPO by the asymmetric clip only (no dynamic sampling); "
    "f_dapo_full adds it [OURS]"
)
_S_FDAPO_NO_OVERLONG = (
    "None: F-GRPO App. B / L.2 name no overlong shaping (rewards 1/0 from math-verify); "
    "f_dapo_full adds DAPO's soft penalty [OURS]"
)
_S_IS_SAMPLER = (
    "IS-GRPO (Why GRPO needs normalization, abstract): prompts drawn with p ~ max(sigma_hat, "
    "sigma_floor) so the expected update is parallel to the full gradient; running estimate, "
    "floor and replacement are [OURS]"
)
_S_IS_POOL = (
    "1024 [OURS]: train prompts drawn once from the run's seed (the paper samples its data "
    "set); is_grpo and is_grpo_baseline draw the same pool"
)
_S_FOCAL_BASELINE = (
    "0: the F-GRPO paper's baseline for this F-preset, every other field equal (App. L.2: its "
    "GRPO, DAPO and CISPO baselines run the same schedule, token mean, no KL)"
)
_S_AVSPO_SCHEDULE = (
    "1: the ACR authors' train_grpo.sh:37,39 (TRL GRPO, per_device_train_batch_size 1, "
    "gradient_accumulation_steps 1) with TRL's num_iterations=1: one step per generation batch"
)
_S_SAME_AS_GRPO = (
    "1 [OURS]: the method changes the advantage, not the update, so GRPO's schedule "
    "(DeepSeekMath §4.2: one update per exploration stage)"
)
_GRPO_SCHEDULE = {"minibatches": _S_GRPO_SCHEDULE, "ppo_epochs": _S_GRPO_SCHEDULE}
_DAPO_SCHEDULE = {"minibatches": _S_DAPO_MB, "ppo_epochs": _S_ONE_EPOCH}
_CISPO_SCHEDULE = {"minibatches": _S_CISPO_MB, "ppo_epochs": _S_ONE_EPOCH}
_FOCAL_SCHEDULE = {
    "minibatches": _S_FOCAL_MB,
    "ppo_epochs": _S_FOCAL_EPOCHS,
    "beta": _S_FOCAL_BETA,
}

_DEFAULT_SOURCES: dict[str, str] = {
    "estimator": "GRPO: (r - mean)/(std + 1e-6), ddof 1 (DeepSeekMath; verl, TRL)",
    "estimator_params": "the estimator's defaults (ALGORITHMS.md §0-§1: ddof 1, eps, tau 1e-6)",
    "focal_gamma": "0: no focal weight (the base method of F-GRPO)",
    "delta_res": "None: no resolution protocol",
    "virtual": "None: no virtual samples",
    "virtual_batch_groups": "None: the code rule, when used, looks at the whole batch",
    "transforms": "{}: no registered transform",
    "reward_combination": "None: the estimator's default (a weighted sum, TRL's "
    "sum_then_normalize; GDPO's own first stage for gdpo)",
    "reward_kl_coef": "0.0: no KL in the reward (verl use_kl_in_reward default False)",
    "reward_kl": "k1: verl kl_penalty default 'kl'; OpenRLHF --algo.kl.estimator default k1",
    "reward_kl_controller": "fixed: verl KLControlConfig.type default",
    "reward_kl_target": "0.1: verl KLControlConfig.target_kl default (adaptive only)",
    "reward_kl_horizon": "10000: verl KLControlConfig.horizon, OpenRLHF --algo.kl.horizon",
    "surrogate": "PPO clipped surrogate (Schulman et al. 2017), as GRPO uses",
    "surrogate_params": _S_GRPO_CLIP,
    "aggregation": "seq-mean-token-mean: GRPO (DeepSeekMath; TRL loss_type='grpo')",
    "kl": "k3 (Schulman 2020; GRPO; verl low_var_kl clamped ±10); only used when beta > 0",
    "beta": "0.0: no KL term (TRL GRPOConfig.beta default; DAPO and Dr.GRPO drop the KL)",
    "dynamic_sampling": "off: every sampled group is used (GRPO, TRL and verl default)",
    "overlong": "None: truncated completions are trained on as they are (TRL default)",
    "controller": "None: fixed clip and temperature",
    "sampler": "uniform: every prompt of the pool equally likely (GRPO, TRL and verl default)",
    "pool_size": "0: a fresh prompt stream from the task (no finite pool)",
    "sampler_weight": "off: no importance weight on the advantages",
    "minibatches": _S_SAME_AS_GRPO,
    "ppo_epochs": _S_SAME_AS_GRPO,
    "rollout_correction": "none: the sources sample and train with one engine at one precision "
    "(TRL's vllm_importance_sampling_correction applies only with vLLM; verl's "
    "rollout_correction.rollout_is defaults to null)",
}


def _p(name: str, description: str, sources: dict[str, str], **kw: Any) -> Preset:
    """A preset whose ``sources`` cite every axis field: the given ones over the defaults."""
    for key in ("estimator_params", "surrogate_params"):
        if key in kw:
            kw[key] = frozen(kw[key])
    unknown = set(sources) - set(_DEFAULT_SOURCES)
    if unknown:
        raise ValueError(f"preset {name!r}: sources for unknown fields {sorted(unknown)}")
    return Preset(
        name=name,
        description=description,
        sources=frozen({**_DEFAULT_SOURCES, **sources}),
        **kw,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _p(
            "grpo",
            "GRPO: group mean/std advantage, PPO clip 0.2, per-sequence token mean",
            _GRPO_SCHEDULE,
        ),
        _p(
            "dr_grpo",
            "Dr.GRPO: no std division, constant length normaliser",
            {
                "estimator": "Dr.GRPO (Liu et al. 2025): A = r - mean, no std division",
                "aggregation": "Dr.GRPO: sum / (sequences · L_max), L_max the generation limit",
            },
            estimator="dr_grpo",
            aggregation="seq_mean_token_sum_norm",
        ),
        _p(
            "dapo",
            "DAPO: clip-higher, token mean, dynamic sampling, soft overlong penalty",
            {
                "surrogate_params": _S_DAPO_CLIP,
                "aggregation": f"{_S_DAPO}: token-level policy-gradient loss",
                "dynamic_sampling": f"{_S_DAPO}: drop groups whose rewards are all equal, resample",
                "overlong": f"{_S_DAPO}: soft overlong punishment (0, then linear to -1 at L_max)",
                **_DAPO_SCHEDULE,
            },
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            dynamic_sampling=True,
            overlong="soft",
            minibatches=16,
        ),
        _p(
            "cispo",
            "CISPO: clipped, stop-gradient IS weight on every token, token mean",
            {
                "surrogate": _S_CISPO,
                "surrogate_params": _S_CISPO_CLIP,
                "aggregation": "CISPO (MiniMax-M1): token mean",
                **_CISPO_SCHEDULE,
            },
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
            minibatches=16,
        ),
        _p(
            "gspo",
            "GSPO: sequence-level ratio with a tight clip",
            {
                "surrogate": "GSPO (Zheng et al. 2025): length-normalised sequence ratio",
                "surrogate_params": "GSPO paper: eps_low 3e-4, eps_high 4e-4",
                "aggregation": "GSPO: sequence-level objective = mean over sequences",
                "minibatches": _S_GSPO_MB,
                "ppo_epochs": _S_ONE_EPOCH,
            },
            surrogate="gspo",
            surrogate_params=_GSPO_CLIP,
            minibatches=4,
        ),
        _p(
            "rloo",
            "RLOO: leave-one-out baseline, PPO clip, token mean",
            {
                "estimator": "RLOO (Ahmadian et al. 2024): r - mean of the others (verl, OpenRLHF)",
                "aggregation": _S_TOKEN_MEAN,
            },
            estimator="rloo",
            aggregation="token_mean",
        ),
        _p(
            "reinforce_pp",
            "REINFORCE++-baseline: group mean then batch whitening",
            {
                "estimator": "REINFORCE++-baseline (Hu 2025; verl reinforce_plus_plus_baseline)",
                "aggregation": _S_TOKEN_MEAN,
            },
            estimator="reinforce_pp",
            aggregation="token_mean",
        ),
        _p(
            "f_grpo",
            "F-GRPO: GRPO with the focal weight (1 - mu)^0.5, token mean",
            {"focal_gamma": _S_FOCAL, "aggregation": _S_FOCAL_AGG, **_FOCAL_SCHEDULE},
            focal_gamma=0.5,
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "f_dapo",
            "F-DAPO as F-GRPO App. B describes DAPO: clip-higher 0.2/0.28, token mean, focal 0.5",
            {
                "focal_gamma": _S_FOCAL,
                "surrogate_params": _S_DAPO_CLIP + "; F-GRPO App. B describes DAPO by this clip",
                "aggregation": _S_FOCAL_AGG,
                "dynamic_sampling": _S_FDAPO_NO_DS,
                "overlong": _S_FDAPO_NO_OVERLONG,
                **_FOCAL_SCHEDULE,
            },
            focal_gamma=0.5,
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "f_dapo_full",
            "F-DAPO with DAPO's dynamic sampling and soft overlong penalty [OURS]",
            {
                "focal_gamma": _S_FOCAL,
                "surrogate_params": _S_DAPO_CLIP,
                "aggregation": _S_FOCAL_AGG,
                "dynamic_sampling": f"[OURS] {_S_DAPO}'s dynamic sampling added to F-DAPO; "
                "F-GRPO App. B describes DAPO by its clip only",
                "overlong": f"[OURS] {_S_DAPO}'s soft overlong penalty added to F-DAPO (the focal "
                "weight's mu still reads the verifier's correctness, F-GRPO eq. 11)",
                **_FOCAL_SCHEDULE,
            },
            focal_gamma=0.5,
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            dynamic_sampling=True,
            overlong="soft",
            minibatches=4,
        ),
        _p(
            "f_cispo",
            "F-CISPO: CISPO with the focal weight (1 - mu)^0.5",
            {
                "focal_gamma": _S_FOCAL + "; F-CISPO on Qwen2.5-7B used 1.0",
                "surrogate": _S_CISPO,
                "surrogate_params": _S_CISPO_CLIP,
                "aggregation": _S_FOCAL_AGG,
                **_FOCAL_SCHEDULE,
            },
            focal_gamma=0.5,
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "avspo",
            "AVSPO: GRPO with adaptive virtual samples in collapsed groups",
            {
                "virtual": "ACR / AVSPO paper; the symmetric values are ours (ALGORITHMS.md §2)",
                "aggregation": _S_TOKEN_MEAN,
                "minibatches": _S_AVSPO_SCHEDULE,
                "ppo_epochs": _S_AVSPO_SCHEDULE,
            },
            virtual="symmetric",
            aggregation="token_mean",
        ),
        _p(
            "avspo_code",
            "AVSPO as its authors' code runs it: one group per generation batch",
            {
                "virtual": (
                    "ACR authors' code: trl_scope/trainer/grpo_trainer.py:1515-1536, one "
                    "virtual reward of the opposite value when a whole generation batch is "
                    "all 0 (or all 1)"
                ),
                "virtual_batch_groups": (
                    "1: train_grpo.sh runs 4 processes × per-device batch 1 completion with "
                    "num_generations 4, so one generation batch holds one group"
                ),
                "aggregation": _S_TOKEN_MEAN + " [OURS] as avspo",
                "minibatches": _S_AVSPO_SCHEDULE,
                "ppo_epochs": _S_AVSPO_SCHEDULE,
            },
            virtual="code",
            virtual_batch_groups=1,
            aggregation="token_mean",
        ),
        _p(
            "maxnorm_rloo",
            "MaxNorm-RLOO: resolution protocol + bounded max-norm scale, KL unscaled",
            {
                "estimator": _S_MAXNORM + "; u = RLOO numerator",
                "delta_res": _S_RES,
                "aggregation": _S_TOKEN_MEAN,
                "kl": _S_KL_UNSCALED,
            },
            estimator="maxnorm_rloo",
            delta_res=1e-2,
            aggregation="token_mean",
        ),
        _p(
            "maxnorm_dr_grpo",
            "MaxNorm-Dr.GRPO: resolution + max-norm on r - mean",
            {
                "estimator": _S_MAXNORM + "; u = r - mean",
                "delta_res": _S_RES,
                "aggregation": _S_TOKEN_MEAN,
                "kl": _S_KL_UNSCALED,
            },
            estimator="maxnorm_dr_grpo",
            delta_res=1e-2,
            aggregation="token_mean",
        ),
        _p(
            "p90",
            "P90: RLOO numerator over its 90th-percentile magnitude",
            {
                "estimator": "percentile-scale robust reference (MaxNorm paper baseline) [OURS]",
                "aggregation": _S_TOKEN_MEAN,
            },
            estimator="p90",
            aggregation="token_mean",
        ),
        _p(
            "gopo",
            "GOPO: centred within-group ranks in [-1, 1]",
            {"estimator": "pure-ranking boundary baseline [OURS]", "aggregation": _S_TOKEN_MEAN},
            estimator="gopo",
            aggregation="token_mean",
        ),
        _p(
            "grpo_beta_comp",
            "GRPO with per-group KL weight 1/(sigma + eps)",
            {
                "estimator": "GRPO+beta_q-comp (MaxNorm paper baseline) [OURS]",
                "aggregation": _S_TOKEN_MEAN,
            },
            estimator="grpo_beta_comp",
            aggregation="token_mean",
        ),
        _p(
            "is_grpo",
            "IS-GRPO: GRPO advantages, prompts drawn with probability ~ max(sigma_hat, floor)",
            {
                "estimator": "IS-GRPO (Why GRPO needs normalization): per-prompt GRPO "
                "normalisation, no extra weight (grouprl.sampling docstring)",
                "aggregation": _S_TOKEN_MEAN,
                "sampler": _S_IS_SAMPLER,
                "pool_size": _S_IS_POOL,
            },
            aggregation="token_mean",
            sampler="sigma",
            pool_size=1024,
        ),
        _p(
            "is_grpo_baseline",
            "GRPO on is_grpo's prompt pool, drawn uniformly: is_grpo's fair baseline",
            {
                "estimator": "GRPO (DeepSeekMath), as is_grpo",
                "aggregation": _S_TOKEN_MEAN + ", as is_grpo",
                "sampler": "uniform over the pool: is_grpo with the sampler off, every other "
                "field equal (Why GRPO needs normalization compares schemes on one data set)",
                "pool_size": _S_IS_POOL,
            },
            aggregation="token_mean",
            pool_size=1024,
        ),
        _p(
            "is_grpo_exact",
            "IS-GRPO with one sigma: r - mean times the draw's importance weight 1/(|pool| p_x)",
            {
                "estimator": "Dr.GRPO's r - mean (no group std): its per-prompt expectation "
                "is ((G-1)/G)·grad J_x at every G [OURS]",
                "aggregation": _S_TOKEN_MEAN,
                "sampler": _S_IS_SAMPLER,
                "pool_size": _S_IS_POOL,
                "sampler_weight": "on [OURS]: 1/(|pool|·p_x) with p_x the probability "
                "the sampler drew x with, so the sigma that draws is the sigma that divides and "
                "the expected update is parallel to the full gradient at every G "
                "(grouprl.sampling docstring)",
            },
            estimator="dr_grpo",
            aggregation="token_mean",
            sampler="sigma",
            pool_size=1024,
            sampler_weight=True,
        ),
        _p(
            "agpo",
            "AGPO: adaptive temperature and clip from a probe group, k1 KL beta 0.03",
            {
                "estimator": "AGPO code: group mean / std advantage (GRPO)",
                "surrogate_params": "AGPO: eps_base 0.2, replaced each step by the adaptive clip",
                "aggregation": "AGPO code: per-sequence token mean, mean over sequences",
                "kl": "AGPO code: k1 (log pi - log pi_ref), token mean",
                "beta": "AGPO README / config: agpo_beta_ref_kl 0.03",
                "controller": "AGPO (wandugu/paper_agpo): adaptive temperature + adaptive clip",
                "minibatches": _S_AGPO_MB,
                "ppo_epochs": _S_AGPO_EPOCHS,
            },
            controller="agpo",
            aggregation="seq_mean_token_mean",
            kl="k1",
            beta=0.03,
            ppo_epochs=4,
        ),
        # -- the peers' methods, estimator / reward side (ALGORITHMS.md §1, §3)
        _p(
            "reinforce_pp_global",
            "REINFORCE++: k1 KL in the reward, returns whitened over the batch's tokens",
            {
                "estimator": "REINFORCE++ (arXiv 2501.03262 §3): global advantage normalisation, "
                "no group baseline; OpenRLHF --algo.advantage.estimator reinforce",
                "aggregation": "OpenRLHF --actor.loss_agg_mode default token-mean "
                "(cli/train_ppo_ray.py)",
                "reward_kl_coef": "0.01: OpenRLHF --algo.kl.init_coef default, folded into the "
                "reward by compute_reward unless --algo.kl.use_loss (cli/train_ppo_ray.py)",
                "reward_kl": "k1: OpenRLHF --algo.kl.estimator default (cli/train_ppo_ray.py)",
            },
            estimator="reinforce_pp_global",
            aggregation="token_mean",
            reward_kl_coef=0.01,
        ),
        _p(
            "gdpo",
            "GDPO: each reward function normalised in its group, the sum whitened over the batch",
            {
                "estimator": "GDPO (arXiv 2601.05242 §3): batch normalisation of the summed, "
                "per-reward normalised advantages",
                "reward_combination": "GDPO §3: group-wise normalisation of each reward before "
                "the sum (TRL normalize_then_sum; verl gdpo)",
                "aggregation": "verl actor loss_agg_mode default token-mean "
                "(verl/trainer/config/actor/actor.yaml:82), which NVlabs/GDPO "
                "verl-GDPO/train_gdpo.sh keeps",
                "minibatches": "4: NVlabs/GDPO verl-GDPO/train_gdpo.sh:46,53 (train_batch_size "
                "512 / ppo_mini_batch_size 128)",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            estimator="gdpo",
            reward_combination="normalize_then_sum",
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "remax",
            "ReMax: greedy-completion baseline, KL folded into the reward",
            {
                "estimator": "ReMax (arXiv 2310.10505, Algorithm 1): the greedy completion's "
                "reward as the baseline; verl remax",
                "aggregation": "verl actor loss_agg_mode default token-mean (actor.yaml:82)",
                "reward_kl_coef": "0.001: verl examples/remax_trainer/"
                "run_qwen2.5-3b_seq_balance.sh:31,33 (use_kl_in_reward, kl_coef 0.001)",
                "reward_kl": "k1: the same script, :32 (kl_penalty=kl)",
                "minibatches": "4: verl examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh:11,19 "
                "(train_batch_size 512 / ppo_mini_batch_size 128)",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            estimator="remax",
            aggregation="token_mean",
            reward_kl_coef=0.001,
            minibatches=4,
        ),
        _p(
            "opo",
            "OPO: length-weighted optimal baseline, exact on-policy, no KL",
            {
                "estimator": "OPO (arXiv 2505.23585 §3): the length-weighted reward baseline, "
                "no std division; verl opo",
                "aggregation": "verl actor loss_agg_mode default token-mean (actor.yaml:82)",
                "minibatches": "1: exact on-policy training, verl docs/algo/opo.md:22,25 "
                "(ppo_mini_batch_size = train_batch_size)",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            estimator="opo",
            aggregation="token_mean",
        ),
        _p(
            "gpg",
            "GPG: batch-corrected group advantage, -A·log π loss, no KL",
            {
                "estimator": "GPG (arXiv 2504.02546): α·(r − mean)/F_norm, α = B/(B − M), "
                "F_norm = 1 (AMAP-ML/GPG README's best row)",
                "surrogate": "GPG: −A·log π, no ratio or clip (verl compute_policy_loss_gpg; "
                "examples/gpg_trainer/run_qwen2-7b_math.sh:29 loss_mode=gpg)",
                "aggregation": "verl actor loss_agg_mode default token-mean (actor.yaml:82)",
                "minibatches": "4: verl examples/gpg_trainer/run_qwen2-7b_math.sh:18,26 "
                "(train_batch_size 1024 / ppo_mini_batch_size 256)",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            estimator="gpg",
            surrogate="reinforce",
            surrogate_params={},
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "otb",
            "Optimal token baseline: per-token variance-weighted baseline, no KL",
            {
                "estimator": "verl optimal_token_baseline (docs/algo/otb.md): "
                "B_t = Σ G_t W_t / Σ W_t over the group",
                "aggregation": "verl actor loss_agg_mode default token-mean (actor.yaml:82)",
                "minibatches": "1: verl examples/otb_trainer/run_qwen2_5-7b.sh:15,26 "
                "(train_batch_size 128 = ppo_mini_batch_size 128)",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            estimator="optimal_token_baseline",
            aggregation="token_mean",
        ),
        # -- the peers' methods, loss side: the surrogates the peers ship, as their sources run them
        _p(
            "sapo",
            "SAPO: soft sigmoid gate instead of a clip, per-sequence token mean",
            {
                "surrogate": "SAPO (Gao et al. 2025, arXiv 2511.20347): soft gate on the ratio",
                "surrogate_params": _S_SAPO_TAU,
                "aggregation": _S_SAPO_AGG,
                "minibatches": _S_SAPO_MB,
                "ppo_epochs": _S_ONE_EPOCH,
            },
            surrogate="sapo",
            surrogate_params=_SAPO_TAU,
            minibatches=4,
        ),
        _p(
            "gmpo",
            "GMPO: geometric mean of the log-clipped token ratios, mean over sequences",
            {
                "estimator": f"{_S_GMPO_SH}:25 --critic_type grpo (group mean / std)",
                "surrogate": "GMPO (Zhao et al. 2025, arXiv 2507.20673): geometric-mean ratio",
                "surrogate_params": f"{_S_GMPO_SH}:20 CLIPRANGE=0.4, log space (TRL GMPOConfig)",
                "aggregation": "GMPO: mean over sequences (TRL GMPOTrainer, verl geo_mean)",
                "beta": f"{_S_GMPO_SH}:38 --beta 0",
                "minibatches": _S_GMPO_MB,
                "ppo_epochs": f"1: {_S_GMPO_SH}:37 --num_ppo_epochs 1",
            },
            surrogate="gmpo",
            surrogate_params=_GMPO_CLIP,
            minibatches=8,
        ),
        _p(
            "vespo",
            "VESPO: gamma weight of the sequence ratio on a REINFORCE term, token mean",
            {
                "surrogate": "VESPO (arXiv 2602.10693; TRL loss_type='vespo')",
                "surrogate_params": "TRL GRPOConfig vespo_k_pos 2, vespo_lambda_pos 3, "
                "vespo_k_neg 3, vespo_lambda_neg 2",
                "aggregation": "TRL: vespo is normalised as dapo, the step's token mean",
                "minibatches": _S_OFF_POLICY_MB.format(method="VESPO"),
                "ppo_epochs": _S_ONE_EPOCH,
            },
            surrogate="vespo",
            surrogate_params=_VESPO_PARAMS,
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "luspo",
            "LUSPO: GSPO's sequence ratio, each sequence weighted by its length",
            {
                "surrogate": "LUSPO (arXiv 2602.05261) = GSPO's sequence-ratio clip "
                "(TRL loss_type='luspo' needs importance_sampling_level='sequence')",
                "surrogate_params": "GSPO paper: eps_low 3e-4, eps_high 4e-4 [OURS: LUSPO as GSPO]",
                "aggregation": "TRL luspo: (per_token_loss * mask).sum(-1).mean(), the mean over "
                "sequences of each sequence's token sum",
                "minibatches": _S_GSPO_MB + " [OURS: LUSPO as GSPO]",
                "ppo_epochs": _S_ONE_EPOCH,
            },
            surrogate="gspo",
            surrogate_params=_GSPO_CLIP,
            aggregation="seq_mean_token_sum",
            minibatches=4,
        ),
    ]
}
"""Preset name -> Preset (ALGORITHMS.md §3)."""

BASELINE_SUFFIX = "_baseline"
"""``<f-preset>_baseline``: the F-preset with γ = 0 and every other field equal (its schedule,
aggregation, clip, β, filters): the paper's baseline for that F-preset (F-GRPO App. L.2)."""


def _baselines(table: dict[str, Preset]) -> dict[str, Preset]:
    """For every preset with a focal weight, ``<name>_baseline``: the same with γ = 0.

    Generated, not written out, so that a baseline can never drift from its F-preset; placed
    right after it in :func:`names`. [OURS] naming: the suffix keeps the pair adjacent and says
    what the preset is for; ``grpo`` stays the GRPO of its own sources (DeepSeekMath's schedule,
    seq-mean-token-mean), which differs from ``f_grpo`` in three fields, not one.
    """
    out: dict[str, Preset] = {}
    for name, p in table.items():
        out[name] = p
        if p.focal_gamma:
            out[name + BASELINE_SUFFIX] = p.with_(
                name=name + BASELINE_SUFFIX,
                description=f"{name} with the focal weight off (γ = 0), every other field equal: "
                "its fair baseline",
                focal_gamma=0.0,
                sources={**p.sources, "focal_gamma": _S_FOCAL_BASELINE},
            )
    return out


PRESETS = _baselines(PRESETS)

from grouprl import registry as _reg  # noqa: E402  (after the table it wraps)

preset_axis = _reg.Axis("preset", PRESETS, callable_=False)
"""The preset axis over :data:`PRESETS` (``register_preset`` adds to it)."""


def baseline_of(name: str) -> Preset:
    """The fair baseline of preset ``name``: ``<name>_baseline``, equal in every field but the
    method's own (γ for an F-preset, the sampler for ``is_grpo``).

    A ValueError for a preset that has none (the message lists those that do).
    """
    get(name)  # an unknown name: the usual error
    if name + BASELINE_SUFFIX not in PRESETS:
        have = [n for n in PRESETS if n + BASELINE_SUFFIX in PRESETS]
        raise ValueError(
            f"preset {name!r} has no fair baseline (no focal weight, no prompt sampler of its "
            f"own); presets with one: {', '.join(have)}"
        )
    return PRESETS[name + BASELINE_SUFFIX]


def names() -> list[str]:
    """Every preset name, in table order (ALGORITHMS.md §3)."""
    return list(PRESETS)


def check(preset: Preset) -> Preset:
    """``preset`` if every name it holds is registered and every parameter is its method's;
    else a ValueError naming the field and the valid choices. Built-in and registered
    presets are held to the same checks."""
    from grouprl import advantages, losses, sampling

    def one_of(key: str, value: str, valid: list[str]) -> None:
        if value not in valid:
            raise ValueError(
                f"preset {preset.name!r}: unknown {key} {value!r}; valid: {', '.join(valid)}"
            )

    one_of("estimator", preset.estimator, advantages.token_names())
    one_of("surrogate", preset.surrogate, list(losses.SURROGATES))
    one_of("aggregation", preset.aggregation, list(losses.AGGREGATIONS))
    one_of("kl", preset.kl, losses.kl_names())
    one_of("sampler", preset.sampler, sampling.names())
    axis = (
        advantages.estimator_axis
        if preset.estimator in advantages.ESTIMATORS
        else advantages.token_estimator_axis
    )
    for key, decl in (
        ("estimator_params", axis.get(preset.estimator)),
        ("surrogate_params", losses.surrogate_axis.get(preset.surrogate)),
    ):
        valid = decl.setting_names()
        unknown = sorted(set(getattr(preset, key)) - set(valid))
        if unknown:
            raise ValueError(
                f"preset {preset.name!r}: {key} {unknown} are not settings of "
                f"{decl.axis} {decl.name!r}; its settings: {', '.join(valid) or 'none'}"
            )
    try:  # the registered transforms: names and settings (the built-ins are fields)
        advantages._registered_transforms(preset.transforms)
    except ValueError as err:
        raise ValueError(f"preset {preset.name!r}: transforms: {err}") from None
    if preset.transforms and preset.estimator not in advantages.ESTIMATORS:
        raise ValueError(
            f"preset {preset.name!r}: transforms act on sequence-level advantages [P, G], "
            f"and {preset.estimator!r} is a token-level estimator; use a sequence-level one "
            "or drop the transforms"
        )
    return preset


def register_preset(preset: Preset | None = None, /, **fields_: Any) -> Preset:
    """Register a preset: a :class:`Preset`, or its fields (``name``, ``description``,
    ``sources`` cited per field over the defaults', and any axis field). Checked as the
    built-ins are (:func:`check`); with a focal weight its ``<name>_baseline`` is registered
    too. A name that is taken is a ``grouprl.registry.RegistrationError``."""
    if preset is None:
        name = fields_.pop("name", None)
        if not isinstance(name, str):
            raise _registry().RegistrationError("register_preset needs name='...'")
        description = fields_.pop("description", "")
        sources = fields_.pop("sources", {})
        for key in ("estimator_params", "surrogate_params"):
            if key in fields_:
                fields_[key] = frozen(fields_[key])
        if "transforms" in fields_:
            fields_["transforms"] = _frozen_transforms(fields_["transforms"])
        unknown = set(sources) - set(_DEFAULT_SOURCES)
        if unknown:
            raise ValueError(f"preset {name!r}: sources for unknown fields {sorted(unknown)}")
        preset = Preset(
            name=name,
            description=description,
            sources=frozen({**_DEFAULT_SOURCES, **sources}),
            **fields_,
        )
    elif fields_:
        raise TypeError("register_preset takes a Preset or its fields, not both")
    check(preset)
    if preset.name.endswith(BASELINE_SUFFIX):
        raise _registry().RegistrationError(
            f"preset {preset.name!r}: names ending in {BASELINE_SUFFIX!r} are the generated "
            "fair baselines; pick another name"
        )
    for p in _baselines({preset.name: preset}).values():
        preset_axis.register(p.name, p)
    return preset


def _registry():
    from grouprl import registry

    return registry


def get(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises a ValueError listing the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
