"""KL-penalty coefficient controllers for a KL folded into the reward (ALGORITHMS.md §4).

    ctrl = make_kl_controller("adaptive", coef=0.001, target=0.1, horizon=10000)
    token_rewards, current_kl = advantages.kl_reward(old_logp, ref_logp, mask, ctrl.value)
    ctrl.update(current_kl, n_steps=num_sequences)
    state = ctrl.state_dict()          # checkpointed with the run

Both follow Ziegler et al. 2019 (arXiv 1909.08593 §2.2) as verl and OpenRLHF implement them
(verl ``trainer/ppo/core_algos.py`` ``AdaptiveKLController`` / ``FixedKLController`` /
``get_kl_controller``; OpenRLHF 0.11 ``trainer/ppo_utils/kl_controller.py``, the same
formula): e = clip(KL/target − 1, −0.2, 0.2), β ← β·(1 + e·n_steps/horizon). verl feeds it
the batch mean of each sequence's token-mean KL with n_steps = the batch's sequences
(``ray_trainer.py`` ``apply_kl_penalty``); defaults from verl's ``KLControlConfig``
(``trainer/config/algorithm.py``: fixed, kl_coef 0.001, horizon 10000, target_kl 0.1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "make_kl_controller",
]

KL_COEF = 0.001
"""verl ``KLControlConfig.kl_coef`` default (OpenRLHF's ``--algo.kl.init_coef`` is 0.01)."""

KL_TARGET = 0.1
"""verl ``KLControlConfig.target_kl`` default."""

KL_HORIZON = 10000
"""verl ``KLControlConfig.horizon`` and OpenRLHF ``--algo.kl.horizon`` default."""

ERROR_CLIP = 0.2
"""Ziegler et al. 2019: the proportional error is clipped to ±0.2 (verl, OpenRLHF)."""


def _finite(name: str, value: Any, *, positive: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


@dataclass
class FixedKLController:
    """β stays ``coef`` (verl ``FixedKLController``; OpenRLHF's when no target is set)."""

    coef: float = KL_COEF
    value: float = float("nan")

    def __post_init__(self) -> None:
        self.coef = _finite("coef", self.coef)
        if math.isnan(self.value):
            self.value = self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """No change; returns β."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = _finite("value", state["value"])


@dataclass
class AdaptiveKLController:
    """β moves toward a target KL: β ← β·(1 + clip(KL/target − 1, ±0.2)·n_steps/horizon).

    Ziegler et al. 2019 §2.2; verl ``AdaptiveKLController.update`` and OpenRLHF's (the same
    arithmetic, NumPy clip). ``n_steps`` is the number of sequences the KL was measured on.
    """

    coef: float = KL_COEF
    target: float = KL_TARGET
    horizon: int = KL_HORIZON
    value: float = float("nan")

    def __post_init__(self) -> None:
        self.coef = _finite("coef", self.coef)
        self.target = _finite("target", self.target, positive=True)
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(
                f"horizon must be an integer > 0 (verl asserts it), got {self.horizon!r}"
            )
        if math.isnan(self.value):
            self.value = self.coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """Advance with the measured KL over ``n_steps`` sequences; returns the new β."""
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"current_kl must be finite, got {current_kl!r}")
        error = min(ERROR_CLIP, max(-ERROR_CLIP, kl / self.target - 1.0))
        self.value *= 1.0 + error * int(n_steps) / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = _finite("value", state["value"])


KL_CONTROLLERS: dict[str, type] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
}
"""KL-in-reward controller name -> class (verl ``kl_ctrl.type``)."""


def make_kl_controller(name: str, **params: Any) -> FixedKLController | AdaptiveKLController:
    """A controller by name with its parameters (``coef``; adaptive: ``target``, ``horizon``)."""
    try:
        cls = KL_CONTROLLERS[name]
    except KeyError:
        raise ValueError(
            f"unknown KL controller {name!r}; valid: {', '.join(KL_CONTROLLERS)}"
        ) from None
    accepted = {"coef"} if cls is FixedKLController else {"coef", "target", "horizon"}
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(
            f"KL controller {name!r} got unknown parameter(s) {sorted(unknown)}; it accepts "
            f"{sorted(accepted)}"
        )
    return cls(**params)
