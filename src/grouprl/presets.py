"""The names users know (grpo, dapo, f_grpo, maxnorm_rloo, ...) as frozen combinations of axes.

A preset fixes one choice per axis: estimator (+ its parameters), transforms (resolution,
virtual samples, focal weight), surrogate (+ clip bounds), aggregation, KL estimator and β,
and batch filters. ``sources`` cites, per parameter, where its value comes from
(ALGORITHMS.md §3). Users override any field with ``dataclasses.replace`` or from the CLI.
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
    Loss half: ``surrogate`` (+ ``surrogate_params``: clip bounds...), ``aggregation``,
    ``kl`` estimator and ``beta`` (0 = no KL term), batch filters ``dynamic_sampling`` and
    ``overlong`` (None | "mask" | "soft"), and ``controller`` (None | "agpo").
    Prompt half: ``sampler``, a name in :data:`grouprl.sampling.SAMPLERS` ("uniform" | "sigma").
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
    sources: MappingProxyType = field(default_factory=frozen)

    def advantage_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``advantages.compute(self.estimator, rewards, **kwargs)``."""
        kwargs: dict[str, Any] = dict(self.estimator_params)
        if self.focal_gamma:
            kwargs["focal_gamma"] = self.focal_gamma
        if self.delta_res is not None:
            kwargs["delta_res"] = self.delta_res
        if self.virtual is not None:
            kwargs["virtual"] = self.virtual
        return kwargs

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

_DEFAULT_SOURCES: dict[str, str] = {
    "estimator": "GRPO: (r - mean)/(std + 1e-6), ddof 1 (DeepSeekMath; verl, TRL)",
    "estimator_params": "the estimator's defaults (ALGORITHMS.md §0-§1: ddof 1, eps, tau 1e-6)",
    "focal_gamma": "0: no focal weight (the base method of F-GRPO)",
    "delta_res": "None: no resolution protocol",
    "virtual": "None: no virtual samples",
    "surrogate": "PPO clipped surrogate (Schulman et al. 2017), as GRPO uses",
    "surrogate_params": _S_GRPO_CLIP,
    "aggregation": "seq-mean-token-mean: GRPO (DeepSeekMath; TRL loss_type='grpo')",
    "kl": "k3 (Schulman 2020; GRPO; verl low_var_kl clamped ±10); only used when beta > 0",
    "beta": "0.0: no KL term (TRL GRPOConfig.beta default; DAPO and Dr.GRPO drop the KL)",
    "dynamic_sampling": "off: every sampled group is used (GRPO, TRL and verl default)",
    "overlong": "None: truncated completions are trained on as they are (TRL default)",
    "controller": "None: fixed clip and temperature",
    "sampler": "uniform: every prompt of the pool equally likely (GRPO, TRL and verl default)",
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
            {},
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
            },
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            dynamic_sampling=True,
            overlong="soft",
        ),
        _p(
            "cispo",
            "CISPO: clipped, stop-gradient IS weight on every token, token mean",
            {
                "surrogate": _S_CISPO,
                "surrogate_params": _S_CISPO_CLIP,
                "aggregation": "CISPO (MiniMax-M1): token mean",
            },
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
        ),
        _p(
            "gspo",
            "GSPO: sequence-level ratio with a tight clip",
            {
                "surrogate": "GSPO (Zheng et al. 2025): length-normalised sequence ratio",
                "surrogate_params": "GSPO paper: eps_low 3e-4, eps_high 4e-4",
                "aggregation": "GSPO: sequence-level objective = mean over sequences",
            },
            surrogate="gspo",
            surrogate_params=_GSPO_CLIP,
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
            {"focal_gamma": _S_FOCAL, "aggregation": "F-GRPO paper: token mean"},
            focal_gamma=0.5,
            aggregation="token_mean",
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
            },
            focal_gamma=0.5,
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            dynamic_sampling=True,
            overlong="soft",
        ),
        _p(
            "f_cispo",
            "F-CISPO: CISPO with the focal weight (1 - mu)^0.5",
            {
                "focal_gamma": _S_FOCAL + "; F-CISPO on Qwen2.5-7B used 1.0",
                "surrogate": _S_CISPO,
                "surrogate_params": _S_CISPO_CLIP,
                "aggregation": "F-GRPO paper / CISPO: token mean",
            },
            focal_gamma=0.5,
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
        ),
        _p(
            "avspo",
            "AVSPO: GRPO with adaptive virtual samples in collapsed groups",
            {
                "virtual": "ACR / AVSPO paper; the symmetric values are ours (ALGORITHMS.md §2)",
                "aggregation": _S_TOKEN_MEAN,
            },
            virtual="symmetric",
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
            },
            controller="agpo",
            aggregation="seq_mean_token_mean",
            kl="k1",
            beta=0.03,
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
