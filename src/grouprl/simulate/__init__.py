"""Simulations that reproduce the papers' analyses on a laptop (``grouprl simulate NAME``).

Each entry of :data:`SIMULATIONS` is ``simulate(quick=False, seed=0, **overrides) -> SimResult``:
it prints nothing, returns table rows, the qualitative claims it checks (each with whether it
holds), matplotlib figures and raw data; :func:`grouprl.simulate._common.write_result` writes
them as JSON + PNG + HTML.
"""

from __future__ import annotations

from collections.abc import Callable

from grouprl.simulate import (
    categorical,
    collapse_over_training,
    low_variance,
    normalization,
    tailmiss,
)
from grouprl.simulate._common import Claim, SimResult, write_result

__all__ = ["SIMULATIONS", "Claim", "SimResult", "get", "names", "write_result"]

SIMULATIONS: dict[str, Callable[..., SimResult]] = {
    "categorical": categorical.simulate,
    "tail-miss": tailmiss.simulate,
    "low-variance": low_variance.simulate,
    "acr": collapse_over_training.simulate,
    "normalization": normalization.simulate,
}
"""Simulation name -> ``simulate(quick=False, seed=0, **overrides) -> SimResult``."""


def names() -> list[str]:
    """Every simulation name."""
    return list(SIMULATIONS)


def get(name: str) -> Callable[..., SimResult]:
    """The simulation called ``name``; ValueError listing the valid names otherwise."""
    try:
        return SIMULATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown simulation {name!r}; valid simulations: {', '.join(SIMULATIONS)}"
        ) from None
