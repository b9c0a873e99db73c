"""Controllers with state across steps; each has ``state_dict()/load_state_dict()``.

- :mod:`grouprl.control.agpo`: AGPO's probe statistics, :class:`AdaptiveTemperature` and
  :class:`AdaptiveClip` (ALGORITHMS.md §4).
- AVSPO's adaptive virtual-sample trigger lives with the estimators it gates:
  :class:`grouprl.advantages.VirtualTrigger` (ALGORITHMS.md §2).
"""

from grouprl.control import agpo
from grouprl.control.agpo import AGPO, AdaptiveClip, AdaptiveTemperature, ProbeStats, probe_stats

CONTROLLERS = {
    "agpo": AGPO,
    "agpo_temperature": AdaptiveTemperature,
    "agpo_clip": AdaptiveClip,
}
"""Controller name -> class (each checkpoints with state_dict / load_state_dict)."""

__all__ = [
    "AGPO",
    "CONTROLLERS",
    "AdaptiveClip",
    "AdaptiveTemperature",
    "ProbeStats",
    "agpo",
    "probe_stats",
]
