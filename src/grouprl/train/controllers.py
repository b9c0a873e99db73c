"""Controllers with state across steps, behind one protocol whose defaults change nothing.

A controller may act at three points of a step (:func:`grouprl.train.loop.train_step`):

1. ``temperature(examples, probe)``: the sampling temperature of this step's groups, one
   float or one per prompt ``[P]`` (default: ``sampling.temperature``); ``probe(examples,
   τ)`` samples a group per example at τ with the policy and returns its rollouts and
   rewards ``[P, G]`` (AGPO's probe group). The log-probs of the step (behaviour,
   training, reference, entropy) are taken at ``logprob_temperature`` when the controller
   sets it, else at that sampling temperature;
2. ``clip_params(policy, batch, params)``: the surrogate's parameters for this step's
   update (default: the preset's, unchanged);
3. ``after_update(policy, batch)``: observe the policy after the update (default: nothing).

Each returns the metrics it wants logged. ``state_dict()`` / ``load_state_dict()`` carry
its state through checkpoints. :data:`CONTROLLERS` maps a preset's ``controller`` field to a
factory; ``None`` is :class:`NoController`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grouprl.tasks.base import Example
from grouprl.train.batch import Batch
from grouprl.train.policy import Policy
from grouprl.types import Rollouts

Probe = Callable[[list[Example], float], tuple[Rollouts, torch.Tensor]]
"""``probe(examples, τ)``: G completions per example at τ and their rewards ``[P, G]``."""

__all__ = [
    "CONTROLLERS",
    "AGPOController",
    "Controller",
    "NoController",
    "Probe",
    "make_controller",
]


class Controller:
    """The protocol, with no-op defaults: a step runs as configured.

    ``base_temperature``: the configured sampling temperature (``sampling.temperature``).
    """

    name: str = "none"
    logprob_temperature: float | None = None
    """The temperature of every log-prob of the step; None = the sampling temperature (TRL,
    verl: ratio 1 on-policy). AGPO's code takes them from the raw logits (1.0)."""

    def __init__(self, base_temperature: float) -> None:
        self.base_temperature = base_temperature

    def temperature(
        self, examples: list[Example], probe: Probe
    ) -> tuple[float | torch.Tensor, dict[str, float]]:
        """This step's sampling temperature, a float or ``[P]`` per prompt, and metrics
        (default: the configured one)."""
        return self.base_temperature, {}

    def clip_params(
        self, policy: Policy, batch: Batch, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """The surrogate's parameters for this update and metrics (default: unchanged)."""
        return params, {}

    def after_update(self, policy: Policy, batch: Batch) -> dict[str, float]:
        """Observe the updated policy; metrics (default: none)."""
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        return None


class NoController(Controller):
    """Fixed temperature and clip bounds (every preset but ``agpo``)."""


class AGPOController(Controller):
    """AGPO (wandugu/paper_agpo): adaptive temperature from a probe group, adaptive clip ε.

    Wraps :class:`grouprl.control.agpo.AGPO` (the controllers' math and state):

    1. a probe group of G completions per prompt at τ_base, never trained on, gives the
       probe statistics and each prompt's τ_t (``AGPO.temperature_from_probe``); prompt p's
       training group is sampled at τ_t[p], and every log-prob of the step (behaviour,
       training, reference, entropy) is taken from the raw logits, T = 1
       (``AGPO.logprob_temperature``, the AGPO code's convention);
    2. each prompt's ε from its probe statistics and the policy's token-mean entropy on its
       training group before the update (``AGPO.clip_params``: ``[P·G]`` bounds);
    3. the update's drift, from the policy's log-probs after the update
       (``AGPO.observe_update``), feeds the next step's ε.

    The controllers' statistics are a few numbers per prompt: they are computed on the CPU
    (explicitly, whatever the policy's device), and ε comes back on the policy's device.
    """

    name = "agpo"

    def __init__(self, base_temperature: float) -> None:
        from grouprl.control.agpo import AGPO

        super().__init__(base_temperature)
        self.agpo = AGPO(base_temperature=base_temperature)
        self.logprob_temperature = self.agpo.logprob_temperature

    def temperature(
        self, examples: list[Example], probe: Probe
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rollouts, rewards = probe(examples, self.base_temperature)  # never trained on
        with torch.device("cpu"):
            taus, metrics = self.agpo.temperature_from_probe(rewards.cpu(), rollouts.texts)
        return taus, metrics  # [P] on the CPU

    def clip_params(
        self, policy: Policy, batch: Batch, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        from grouprl.control.agpo import group_token_mean

        entropy = policy.batch_logprobs(batch, entropy=True).entropy
        h = group_token_mean(entropy, batch.mask, batch.group_size).cpu()  # [P]
        with torch.device("cpu"):
            eps = self.agpo.clip_params(h, batch.group_size)
        device = policy.device
        eps = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in eps.items()}
        return {**params, **eps}, {}

    def after_update(self, policy: Policy, batch: Batch) -> dict[str, float]:
        new_logp = policy.batch_logprobs(batch).logp
        old, new, mask = (t.cpu() for t in (batch.old_logp, new_logp, batch.mask))
        with torch.device("cpu"):
            return self.agpo.observe_update(old, new, mask, batch.group_size)

    def state_dict(self) -> dict[str, Any]:
        return self.agpo.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.agpo.load_state_dict(state)


CONTROLLERS: dict[str | None, Callable[[Any], Controller]] = {
    None: lambda cfg: NoController(base_temperature=cfg.sampling.temperature),
    "agpo": lambda cfg: AGPOController(base_temperature=cfg.sampling.temperature),
}
"""A preset's ``controller`` field -> factory taking the RunConfig."""


def make_controller(name: str | None, cfg: Any) -> Controller:
    """The controller a preset names (``None`` = no controller)."""
    if name not in CONTROLLERS:
        valid = ", ".join(str(k) for k in CONTROLLERS)
        raise ValueError(f"unknown controller {name!r}; valid: {valid}")
    return CONTROLLERS[name](cfg)
