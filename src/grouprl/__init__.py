"""grouprl: group-relative RL with verifiable rewards for language models.

The public API (see the README):

    from grouprl import advantages, losses, diagnostics
    out = advantages.compute("maxnorm_rloo", rewards)     # rewards [P, G], NaN = missing
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {
    "advantages",
    "losses",
    "diagnostics",
    "presets",
    "sampling",
    "control",
    "simulate",
    "tasks",
    "rollout",
    "train",
    "report",
    "models",
    "integrations",
    "types",
}


def __getattr__(name: str) -> Any:
    # Lazy submodules: `import grouprl` stays cheap, `grouprl.advantages` works as expected.
    if name in _SUBMODULES:
        return importlib.import_module(f"grouprl.{name}")
    raise AttributeError(f"module 'grouprl' has no attribute {name!r}")
