"""Tail-miss and active-group probabilities of group sampling, and a group-size advisor.

ALGORITHMS.md §5 [PAPER: F-GRPO, Lemma 3.1]. A prompt is solved with probability μ; a
rare-correct subset carries mass τ (0 ≤ τ ≤ μ). With N samples per group:

- P(active) = 1 − μ^N − (1 − μ)^N: the group is mixed, so it produces a gradient;
- P(tail miss) = (1 − τ)^N − (μ − τ)^N − (1 − μ)^N: the group is active yet samples no
  rare-correct answer, so the update pushes mass onto the common correct answers and
  away from the rare ones. It is 0 at N = 1, rises, peaks and falls again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "DEFAULT_CANDIDATES",
    "GroupSizeAdvice",
    "advise_group_size",
    "p_active",
    "tail_miss_probability",
]

DEFAULT_CANDIDATES = (2, 4, 8, 16, 32, 64, 128)
"""Group sizes the advisor compares [OURS: powers of two, as practice uses]."""


def _backend(*xs):
    return torch if any(isinstance(x, torch.Tensor) for x in xs) else np


def _prep(xs, names):
    """Broadcastable float64 arrays (numpy) or tensors (torch) and whether all were scalars."""
    lib = _backend(*xs)
    if lib is torch:
        dev = next(x.device for x in xs if isinstance(x, torch.Tensor))
        arrs = [torch.as_tensor(x, dtype=torch.float64, device=dev) for x in xs]
    else:
        arrs = [np.asarray(x, dtype=np.float64) for x in xs]
    scalar = all(np.ndim(x) == 0 and not isinstance(x, torch.Tensor) for x in xs)
    for name, a in zip(names, arrs):
        bad = (a != a).any() if lib is np else bool(torch.isnan(a).any())
        if bad:
            raise ValueError(f"{name} contains NaN")
    return lib, arrs, scalar


def _check_n(lib, n):
    if bool((n < 1).any()) or bool((n != lib.floor(n)).any()):
        raise ValueError("n (the group size) must be a positive integer, or an array of them")


def _check_mu(lib, mu):
    if bool(((mu < 0) | (mu > 1)).any()):
        raise ValueError("mu (a success probability) must lie in [0, 1]")


def p_active(mu, n):
    """Probability that a group of ``n`` samples is mixed: 1 − μ^n − (1 − μ)^n.

    [PAPER: F-GRPO Lemma 3.1]. ``mu`` in [0, 1], ``n`` ≥ 1 integer; numpy or torch inputs
    broadcast (float64 out; a float when all inputs are Python scalars). At n = 1 it is 0.
    """
    lib, (mu_a, n_a), scalar = _prep((mu, n), ("mu", "n"))
    _check_mu(lib, mu_a)
    _check_n(lib, n_a)
    out = 1.0 - mu_a**n_a - (1.0 - mu_a) ** n_a
    # μ ∈ {0, 1}: the formula gives 1 − 1 − 0 = 0 exactly already; clamp float noise below 0.
    out = out.clip(0.0, 1.0) if lib is np else out.clamp(0.0, 1.0)
    return float(out) if scalar else out


def tail_miss_probability(mu, tau, n):
    """P(group is active but samples no rare-correct answer) = (1−τ)^n − (μ−τ)^n − (1−μ)^n.

    [PAPER: F-GRPO Lemma 3.1; check values in ALGORITHMS.md §5: μ = 0.5, τ = 0.05 gives 0.45,
    0.711, 0.658, 0.440, 0.194 at n = 2, 4, 8, 16, 32]. Needs 0 ≤ τ ≤ μ ≤ 1 and integer n ≥ 1;
    numpy or torch inputs broadcast (float64 out; a float for Python scalars). At n = 1 it is
    exactly 0; τ = 0 reduces it to :func:`p_active`.
    """
    lib, (mu_a, tau_a, n_a), scalar = _prep((mu, tau, n), ("mu", "tau", "n"))
    _check_mu(lib, mu_a)
    _check_n(lib, n_a)
    if bool(((tau_a < 0) | (tau_a > mu_a)).any()):
        raise ValueError("tau (rare-correct mass) must satisfy 0 <= tau <= mu")
    out = (1.0 - tau_a) ** n_a - (mu_a - tau_a) ** n_a - (1.0 - mu_a) ** n_a
    out = out.clip(0.0, 1.0) if lib is np else out.clamp(0.0, 1.0)
    return float(out) if scalar else out


@dataclass(frozen=True)
class GroupSizeAdvice:
    """Result of :func:`advise_group_size`: per-candidate numbers and the recommendation."""

    candidates: tuple[int, ...]
    active: tuple[float, ...]
    """Expected fraction of mixed (gradient-producing) groups at each N."""
    tail_miss: tuple[float, ...]
    """Expected fraction of groups that are active but miss the rare-correct mode at each N."""
    recommended: int
    reason: str
    targets: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[tuple[int, float, float]]:
        """``(N, active, tail_miss)`` per candidate, for a table."""
        return list(zip(self.candidates, self.active, self.tail_miss))


def advise_group_size(
    mu,
    rho: float = 0.1,
    *,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
    min_active: float = 0.6,
    max_tail_miss: float = 0.25,
) -> GroupSizeAdvice:
    """Recommend a group size N from per-prompt success estimates ``mu`` ``[P]``.

    For each candidate N: the expected active fraction mean_q P(active | μ_q, N), and the
    expected tail-miss risk mean_q P(tail miss | μ_q, τ_q = ρ·μ_q, N), where ``rho`` is the
    share of each prompt's correct mass held by rare modes [OURS: one ρ for the batch].
    Rule [OURS]: the target active fraction is ``min_active``, lowered to 90 % of the best any
    candidate reaches when prompts at μ̂ ∈ {0, 1} cap it; the advice is the smallest N (fewest
    rollouts) reaching the target with tail miss ≤ ``max_tail_miss``, else the smallest N
    reaching the target, with a pointer to F-GRPO's focal weight against tail misses (and what
    our maze reproduction found of it), and to a curriculum / dynamic sampling when the cap
    binds (avspo did not lower the raw ACR in our ACR reproduction). Raises ValueError on an empty ``mu``.
    """
    mu_a = np.asarray(mu.detach().cpu() if isinstance(mu, torch.Tensor) else mu, dtype=np.float64)
    mu_a = mu_a.reshape(-1)
    if mu_a.size == 0:
        raise ValueError("mu is empty: pass at least one per-prompt success estimate")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho (rare share of the correct mass) must lie in [0, 1], got {rho}")
    cand = np.asarray(sorted(set(int(c) for c in candidates)), dtype=np.float64)
    act = p_active(mu_a[None, :], cand[:, None]).mean(axis=1)  # [C]
    miss = tail_miss_probability(mu_a[None, :], rho * mu_a[None, :], cand[:, None]).mean(axis=1)
    best = float(act.max())
    target = min(min_active, 0.9 * best)  # [OURS]: what this batch can reach at all
    reach = act >= target - 1e-12
    ok = reach & (miss <= max_tail_miss)
    i = int(np.argmax(ok)) if ok.any() else int(np.argmax(reach))
    reason = (
        f"smallest N with expected active fraction {act[i]:.2f} >= {target:.2f} and "
        f"tail-miss risk {miss[i]:.2f} <= {max_tail_miss:g}"
        if ok.any()
        else f"smallest N with expected active fraction {act[i]:.2f} >= {target:.2f}; no "
        f"candidate keeps tail-miss risk <= {max_tail_miss:g} there ({miss[i]:.2f}): F-GRPO's "
        "focal weight (focal_gamma) targets this; on our maze it raised pass@128 but at "
        "gamma 0.5 no more than a lower lr did (reproductions/maze)"
    )
    if best < min_active:
        reason += (
            f"; at most {best:.0%} of groups can be active at any N here (success estimates "
            "near 0 or 1): a prompt curriculum or dynamic sampling; avspo's virtual samples "
            "did not lower the raw collapse rate in our ACR reproduction (reproductions/acr)"
        )
    return GroupSizeAdvice(
        candidates=tuple(int(c) for c in cand),
        active=tuple(float(a) for a in act),
        tail_miss=tuple(float(m) for m in miss),
        recommended=int(cand[i]),
        reason=reason,
        targets={"min_active": min_active, "max_tail_miss": max_tail_miss, "rho": rho},
    )
