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

__all__ = ["PRESETS", "Preset", "get", "names"]


def _frozen(d: dict[str, Any] | None = None) -> MappingProxyType:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Preset:
    """One frozen combination of every axis. Field defaults are GRPO's (verl / TRL)."""

    name: str
    description: str
    # -- advantage half (ALGORITHMS.md §1-§2)
    estimator: str = "grpo"
    estimator_params: MappingProxyType = field(default_factory=_frozen)
    focal_gamma: float = 0.0
    delta_res: float | None = None
    virtual: str | None = None
    # -- loss half (ALGORITHMS.md §3)
    surrogate: str = "ppo_clip"
    surrogate_params: MappingProxyType = field(
        default_factory=lambda: _frozen({"eps_low": 0.2, "eps_high": 0.2})
    )
    aggregation: str = "seq_mean_token_mean"
    kl: str = "k3"
    beta: float = 0.0
    dynamic_sampling: bool = False
    overlong: str | None = None  # None | "mask" | "soft"
    controller: str | None = None  # None | "agpo"
    sources: MappingProxyType = field(default_factory=_frozen)

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
                changes[key] = _frozen(changes[key])
        return replace(self, **changes)


_GRPO_CLIP = {"eps_low": 0.2, "eps_high": 0.2}
_DAPO_CLIP = {"eps_low": 0.2, "eps_high": 0.28}
_CISPO_CLIP = {"eps_low": 1.0, "eps_high": 5.0}
_GSPO_CLIP = {"eps_low": 3e-4, "eps_high": 4e-4}

_S_GRPO = "DeepSeekMath GRPO; verl/TRL defaults (clip 0.2, seq-mean-token-mean)"
_S_DAPO = "DAPO (Yu et al. 2025): clip-higher 0.2/0.28, token-mean, dynamic sampling, overlong"
_S_CISPO = "MiniMax-M1 CISPO; eps 1.0/5.0 as F-GRPO and ScaleRL use"
_S_FOCAL = "F-GRPO (focal weight (1-mu)^gamma, gamma=0.5 default)"
_S_MAXNORM = "MaxNorm-AC (advantage scale calibration paper): s_q = max(tau_res, max|u|)"


def _p(name: str, description: str, sources: dict[str, str], **kw: Any) -> Preset:
    for key in ("estimator_params", "surrogate_params"):
        if key in kw:
            kw[key] = _frozen(kw[key])
    return Preset(name=name, description=description, sources=_frozen(sources), **kw)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _p(
            "grpo",
            "GRPO: group mean/std advantage, PPO clip 0.2, per-sequence token mean",
            {"estimator": _S_GRPO, "surrogate_params": _S_GRPO, "aggregation": _S_GRPO},
        ),
        _p(
            "dr_grpo",
            "Dr.GRPO: no std division, constant length normaliser",
            {"estimator": "Dr.GRPO (Liu et al. 2025)", "aggregation": "Dr.GRPO: sum / (N * L_max)"},
            estimator="dr_grpo",
            aggregation="seq_mean_token_sum_norm",
        ),
        _p(
            "dapo",
            "DAPO: clip-higher, token mean, dynamic sampling, soft overlong penalty",
            {
                "surrogate_params": _S_DAPO,
                "aggregation": _S_DAPO,
                "dynamic_sampling": _S_DAPO,
                "overlong": _S_DAPO,
            },
            surrogate_params=_DAPO_CLIP,
            aggregation="token_mean",
            dynamic_sampling=True,
            overlong="soft",
        ),
        _p(
            "cispo",
            "CISPO: clipped, stop-gradient IS weight on every token, token mean",
            {"surrogate": _S_CISPO, "surrogate_params": _S_CISPO, "aggregation": _S_CISPO},
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
        ),
        _p(
            "gspo",
            "GSPO: sequence-level ratio with a tight clip",
            {"surrogate": "GSPO (Zheng et al. 2025)", "surrogate_params": "GSPO: 3e-4 / 4e-4"},
            surrogate="gspo",
            surrogate_params=_GSPO_CLIP,
        ),
        _p(
            "rloo",
            "RLOO: leave-one-out baseline, PPO clip, token mean",
            {"estimator": "RLOO (Ahmadian et al. 2024); verl / OpenRLHF"},
            estimator="rloo",
            aggregation="token_mean",
        ),
        _p(
            "reinforce_pp",
            "REINFORCE++-baseline: group mean then batch whitening",
            {"estimator": "REINFORCE++ (Hu 2025); verl reinforce_plus_plus_baseline"},
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
            {"focal_gamma": _S_FOCAL, "surrogate_params": _S_DAPO},
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
                "surrogate_params": _S_CISPO,
            },
            focal_gamma=0.5,
            surrogate="cispo",
            surrogate_params=_CISPO_CLIP,
            aggregation="token_mean",
        ),
        _p(
            "avspo",
            "AVSPO: GRPO with adaptive virtual samples in collapsed groups",
            {"virtual": "ACR / AVSPO paper; symmetric values are ours (ALGORITHMS.md §2)"},
            virtual="symmetric",
            aggregation="token_mean",
        ),
        _p(
            "maxnorm_rloo",
            "MaxNorm-RLOO: resolution protocol + bounded max-norm scale, KL unscaled",
            {"estimator": _S_MAXNORM, "delta_res": "MaxNorm paper resolution protocol, 1e-2"},
            estimator="maxnorm_rloo",
            delta_res=1e-2,
            aggregation="token_mean",
        ),
        _p(
            "maxnorm_dr_grpo",
            "MaxNorm-Dr.GRPO: resolution + max-norm on r - mean",
            {"estimator": _S_MAXNORM, "delta_res": "MaxNorm paper resolution protocol, 1e-2"},
            estimator="maxnorm_dr_grpo",
            delta_res=1e-2,
            aggregation="token_mean",
        ),
        _p(
            "p90",
            "P90: RLOO numerator over its 90th-percentile magnitude",
            {"estimator": "percentile-scale robust reference (MaxNorm paper baseline) [OURS]"},
            estimator="p90",
            aggregation="token_mean",
        ),
        _p(
            "gopo",
            "GOPO: centred within-group ranks in [-1, 1]",
            {"estimator": "pure-ranking boundary baseline [OURS]"},
            estimator="gopo",
            aggregation="token_mean",
        ),
        _p(
            "grpo_beta_comp",
            "GRPO with per-group KL weight 1/(sigma + eps)",
            {"estimator": "GRPO+beta_q-comp (MaxNorm paper baseline) [OURS]"},
            estimator="grpo_beta_comp",
            aggregation="token_mean",
        ),
        _p(
            "is_grpo",
            "IS-GRPO: per-prompt normalisation re-weighted by sigma_q / mean sigma",
            {"estimator": "IS-GRPO (Why GRPO needs normalization) [OURS reconstruction]"},
            estimator="is_grpo",
            aggregation="token_mean",
        ),
        _p(
            "agpo",
            "AGPO: adaptive temperature and clip from a probe group, k1 KL beta 0.03",
            {"controller": "AGPO (wandugu/paper_agpo)", "beta": "AGPO code: k1, 0.03"},
            controller="agpo",
            aggregation="token_mean",
            kl="k1",
            beta=0.03,
        ),
    ]
}
"""Preset name -> Preset (ALGORITHMS.md §3)."""


def names() -> list[str]:
    return list(PRESETS)


def get(name: str) -> Preset:
    """The preset called ``name``; an unknown name raises a ValueError listing the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
