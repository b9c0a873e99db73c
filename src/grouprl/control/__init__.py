"""Controllers with state across steps; each has ``state_dict()/load_state_dict()``.

- :mod:`grouprl.control.agpo`: AGPO's probe statistics, :class:`AdaptiveTemperature` and
  :class:`AdaptiveClip` (ALGORITHMS.md §4).
- :mod:`grouprl.control.kl`: the fixed and adaptive KL-penalty coefficient of a KL folded
  into the reward (verl ``kl_ctrl``; ALGORITHMS.md §4).
- AVSPO's adaptive virtual-sample trigger lives with the estimators it gates:
  :class:`grouprl.advantages.VirtualTrigger` (ALGORITHMS.md §2).
"""

from grouprl.control import agpo, kl
from grouprl.control.agpo import AGPO, AdaptiveClip, AdaptiveTemperature, ProbeStats, probe_stats
from grouprl.control.kl import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)

CONTROLLERS = {
    "agpo": AGPO,
    "agpo_temperature": AdaptiveTemperature,
    "agpo_clip": AdaptiveClip,
    "kl_fixed": FixedKLController,
    "kl_adaptive": AdaptiveKLController,
}
"""Controller name -> class (each checkpoints with state_dict / load_state_dict)."""

PER_PROMPT: frozenset[str] = frozenset({"agpo"})
"""A preset's ``controller`` values that set each prompt's temperature and ε from its probe
group: they cannot run with dynamic sampling, which replaces groups with prompts drawn
later (the AGPO code has no dynamic sampling)."""

__all__ = [
    "AGPO",
    "CONTROLLERS",
    "KL_CONTROLLERS",
    "PER_PROMPT",
    "AdaptiveClip",
    "AdaptiveKLController",
    "AdaptiveTemperature",
    "FixedKLController",
    "ProbeStats",
    "agpo",
    "kl",
    "make_kl_controller",
    "probe_stats",
]
