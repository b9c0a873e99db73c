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

__all__ = ["PRESETS", "Preset", "frozen", "get", "names"]


def frozen(d: Any = None) -> MappingProxyType:
    """A read-only copy of a mapping (``{}`` for None): the dict fields of frozen configs."""
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Preset:
    """One frozen combination of every axis. Field defaults are GRPO's (verl / TRL).

    Advantage half: ``estimator`` (+ ``estimator_params``), ``focal_gamma`` (0 = off),
    ``delta_res`` (resolution protocol, None = off), ``virtual`` (AVSPO mode, None = off).
    Reward side: ``reward_combination`` of several reward functions (None: the estimator's
    default, ``advantages.DEFAULT_COMBINATION``) and a KL folded into the reward
    (``reward_kl_coef`` > 0: ``reward_kl`` estimator, ``reward_kl_controller`` "fixed" or
    "adaptive" with ``reward_kl_target`` / ``reward_kl_horizon``; verl ``use_kl_in_reward``).
    Loss half: ``surrogate`` (+ ``surrogate_params``: clip bounds...), ``aggregation``,
    ``kl`` estimator and ``beta`` (0 = no KL term), batch filters ``dynamic_sampling`` and
    ``overlong`` (None | "mask" | "soft"), and ``controller`` (None | "agpo").
    Prompt half: ``sampler``, a name in :data:`grouprl.sampling.SAMPLERS` ("uniform" | "sigma").
    Update schedule: ``minibatches`` (optimizer steps per epoch over one generation batch, each
    on whole groups) and ``ppo_epochs`` (passes over the batch); the trainer runs them unless
    ``optim.minibatches`` / ``optim.ppo_epochs`` are set (ALGORITHMS.md §3 "Update schedule").
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
    # -- update schedule (ALGORITHMS.md §3): minibatches × ppo_epochs optimizer steps per batch
    minibatches: int = 1
    ppo_epochs: int = 1
    sources: MappingProxyType = field(default_factory=frozen)

    def __post_init__(self) -> None:
        for key in ("minibatches", "ppo_epochs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"preset {self.name!r}: {key} must be an integer >= 1 (optimizer steps per "
                    f"generation batch = minibatches × ppo_epochs), got {value!r}"
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

    def with_(self, **changes: Any) -> Preset:
        """A copy with some fields changed (dict fields are re-frozen)."""
        for key in ("estimator_params", "surrogate_params", "sources"):
            if key in changes and not isinstance(changes[key], MappingProxyType):
                changes[key] = frozen(changes[key])
        return replace(self, **changes)


_GRPO_CLIP = {"eps_low": 0.2, "eps_high": 0.2}
_DAPO_CLIP = {"eps_low": 0.2, "eps_high": 0.28}
_CISPO_CLIP = {"eps_low": 1.0, "eps_high": 5.0}
_GSPO_CLIP = {"eps_low": 3e-4, "eps_high": 4e-4}

_S_GRPO_CLIP = "GRPO / PPO clip 0.2/0.2 (DeepSeekMath; verl clip_ratio, TRL epsilon default)"
_S_DAPO = "DAPO (Yu et al. 2025)"
_S_DAPO_CLIP = "DAPO clip-higher: eps_low 0.2, eps_high 0.28"
_S_TOKEN_MEAN = "token mean over the step (DAPO; verl token-mean; ALGORITHMS.md §3 table)"
_S_CISPO = "CISPO (MiniMax-M1): clipped stop-gradient IS weight on every token"
_S_CISPO_CLIP = "eps 1.0/5.0 (weight in [0, 6]) as F-GRPO and ScaleRL use"
_S_FOCAL = "F-GRPO: focal weight (1 - mu)^gamma, gamma 0.5 (the paper picked 0.5 or 1.0)"
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
_FOCAL_SCHEDULE = {"minibatches": _S_FOCAL_MB, "ppo_epochs": _S_FOCAL_EPOCHS}

_DEFAULT_SOURCES: dict[str, str] = {
    "estimator": "GRPO: (r - mean)/(std + 1e-6), ddof 1 (DeepSeekMath; verl, TRL)",
    "estimator_params": "the estimator's defaults (ALGORITHMS.md §0-§1: ddof 1, eps, tau 1e-6)",
    "focal_gamma": "0: no focal weight (the base method of F-GRPO)",
    "delta_res": "None: no resolution protocol",
    "virtual": "None: no virtual samples",
    "virtual_batch_groups": "None: the code rule, when used, looks at the whole batch",
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
    "minibatches": _S_SAME_AS_GRPO,
    "ppo_epochs": _S_SAME_AS_GRPO,
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
            {"focal_gamma": _S_FOCAL, "aggregation": "F-GRPO paper: token mean", **_FOCAL_SCHEDULE},
            focal_gamma=0.5,
            aggregation="token_mean",
            minibatches=4,
        ),
        _p(
            "f_dapo",
            "F-DAPO: DAPO with the focal weight (1 - mu)^0.5",
            {
                "focal_gamma": _S_FOCAL,
                "surrogate_params": _S_DAPO_CLIP,
                "aggregation": "F-GRPO paper / DAPO: token mean",
                "dynamic_sampling": f"{_S_DAPO}, as the F-DAPO base",
                "overlong": f"{_S_DAPO}, as the F-DAPO base",
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
                "aggregation": "F-GRPO paper / CISPO: token mean",
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
                "sampler": "IS-GRPO (Why GRPO needs normalization, abstract): prompts drawn "
                "with p ~ max(sigma_hat, sigma_floor) so the expected update is parallel to the "
                "full gradient; running estimate, floor and replacement are [OURS]",
            },
            aggregation="token_mean",
            sampler="sigma",
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
    ]
}
"""Preset name -> Preset (ALGORITHMS.md §3)."""


def names() -> list[str]:
    """Every preset name, in table order (ALGORITHMS.md §3)."""
    return list(PRESETS)


def get(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises a ValueError listing the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
