"""The first thing a run report says: what improved, by how much, and what to look at.

Pure functions over the logged metric rows (``report.run.read_metrics``) and the run's
health episodes (``diagnostics.RunHealth.episodes``), plus the curve smoothing the report
draws (:func:`ema`). [OURS]: a report opens on what changed, not on a table of last values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EMA_ALPHA", "Change", "Glance", "distinct_series", "ema", "glance"]

EMA_ALPHA = 0.1
"""Weight of the newest step in the report's smoothed curves (the past keeps 1 − α = 0.9:
about a 10-step memory) [OURS]."""

FELL = 0.02
"""An evaluation number that fell by at least this much is pointed out [OURS: about 2 SE of
pass@16 on 200 prompts × 16 samples at p ≈ 0.4]."""

STILL = 0.01
"""pass@1 that rose by less than this counts as not improved [OURS]."""

ACR_ROSE = 0.1
"""A collapse rate (mean over the last tenth of the steps against the first) that rose by at
least this much is pointed out, before any health rule fires [OURS]."""

STALL = 0.35
"""The stall rule's threshold (``HealthConfig.stall_acr``), quoted in that line."""


def ema(values: Sequence[float], alpha: float = EMA_ALPHA) -> list[float]:
    """Debiased exponential moving average: ``m_t = (1 − α)·m_{t−1} + α·x_t`` from
    ``m_0 = 0``, shown as ``m_t / (1 − (1 − α)^t)`` (Adam's bias correction, as TensorBoard's
    smoothing does), so the first value is ``x_1`` and a constant series stays constant."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out, m, keep = [], 0.0, 1.0
    for x in values:
        m = (1 - alpha) * m + alpha * float(x)
        keep *= 1 - alpha
        out.append(m / (1 - keep))
    return out


@dataclass(frozen=True)
class Change:
    """One number at the start and at the end of the run."""

    key: str
    label: str
    start: float
    end: float
    where: str
    """``step 0 → step 300``, or ``steps 1–30 → steps 271–300`` for per-step means."""

    @property
    def delta(self) -> float:
        return self.end - self.start

    def sentence(self, digits: int = 3) -> str:
        return (
            f"{self.label} {self.start:.{digits}f} → {self.end:.{digits}f} "
            f"({self.delta:+.{digits}f})"
        )


@dataclass(frozen=True)
class Glance:
    """The report's opening: a headline, the changes behind it, and what to look at."""

    headline: str
    changes: list[Change]
    look_at: list[str]


def _finite(rows: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]


def distinct_series(rows: list[dict[str, float]], keys: list[str]) -> tuple[str, ...]:
    """``keys`` without those whose logged series repeats an earlier key's to within 1e-3 (a
    binary reward's ``eval/reward_mean`` is ``eval/pass@1`` up to rounding)."""
    seen: list[tuple[list[float], list[float]]] = []
    out = []
    for key in keys:
        pts = _finite(rows, key)
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        if not any(x == x2 and all(abs(a - b) < 1e-3 for a, b in zip(y, y2)) for x2, y2 in seen):
            seen.append((x, y))
            out.append(key)
    return tuple(out)


def _eval_changes(rows: list[dict[str, float]]) -> list[Change]:
    keys = sorted({k for r in rows for k in r if k.startswith("eval/")}, key=_pass_order)
    keys = list(distinct_series(rows, keys))
    out = []
    for key in keys:
        pts = _finite(rows, key)
        if len(pts) >= 2:
            (s0, v0), (s1, v1) = pts[0], pts[-1]
            where = f"step {int(s0)} → step {int(s1)}"
            out.append(Change(key, key.split("/", 1)[1], v0, v1, where))
    return out


def _pass_order(key: str) -> tuple[int, str]:
    tail = key.rsplit("@", 1)[-1]
    return (int(tail), key) if tail.isdigit() else (10**9, key)


def _mean_change(rows: list[dict[str, float]], key: str, label: str) -> Change | None:
    """The mean over the first tenth of the logged steps against the last tenth."""
    pts = [(s, v) for s, v in _finite(rows, key) if s >= 1]
    if len(pts) < 10:
        return None
    n = max(1, len(pts) // 10)
    head, tail = pts[:n], pts[-n:]
    where = (
        f"steps {int(head[0][0])}–{int(head[-1][0])} → steps {int(tail[0][0])}–{int(tail[-1][0])}"
    )
    return Change(
        key,
        label,
        sum(v for _, v in head) / n,
        sum(v for _, v in tail) / n,
        where,
    )


def _headline(evals: list[Change], train: list[Change], protocol: str) -> str:
    if evals:
        shown = [c for c in evals if c.label in ("pass@1",)] + [
            c for c in evals if c.label != "pass@1"
        ]
        parts = ", ".join(c.sentence() for c in shown[:3])
        return f"Held-out {parts}, {evals[0].where}{protocol}."
    if train:
        return f"Training {train[0].sentence()} ({train[0].where}); no held-out evaluation logged."
    return "Too few logged steps for a before/after comparison."


def glance(
    rows: list[dict[str, float]], episodes: Sequence[Any] = (), config: Any = None
) -> Glance:
    """What improved, by how much, and what to look at, from the logged rows.

    ``episodes``: the run's health episodes (``rule``, ``span``, ``open``), each named once.
    ``config``: config.yaml as a dict, for the evaluation protocol in the headline.
    """
    evals = _eval_changes(rows)
    train = [
        c
        for c in (
            _mean_change(rows, "reward/mean", "train reward"),
            _mean_change(rows, "acr/rate", "collapsed groups (ACR)"),
        )
        if c is not None
    ]
    look: list[str] = []
    for ep in episodes:
        still = ", still on at the end" if getattr(ep, "open", False) else ""
        look.append(f"health: {ep.rule} over {ep.span}{still}; the Health section says what to do")
    prompts = _eval_prompts(config)
    for c in evals:
        if c.delta <= -FELL:
            noise = ""
            if prompts:  # the standard error of a share over that many prompts, doubled
                two_se = 2 * math.sqrt(max(c.start * (1 - c.start), 1e-12) / prompts)
                noise = f" ({prompts} held-out prompts: a change under ~{two_se:.2f} may be noise)"
            look.append(
                f"{c.label} fell by {-c.delta:.3f}{noise}: the policy sharpened onto fewer "
                "answers; a lower optim.lr or fewer steps keep more of it"
            )
    first = next((c for c in evals if c.label == "pass@1"), None)
    if first is not None and first.delta < STILL:
        look.append(
            f"pass@1 did not improve ({first.delta:+.3f}): check the reward curve and the "
            "collapse rate below"
        )
    acr = next((c for c in train if c.key == "acr/rate"), None)
    if acr is not None and acr.delta >= ACR_ROSE and not episodes:
        look.append(
            f"collapsed groups rose {acr.start:.2f} → {acr.end:.2f} ({acr.where}): fewer "
            f"groups carry a gradient; the stall rule fires above {STALL:g} for 50 steps"
        )
    if not look:
        held = [c.label for c in evals if c.delta <= 0]
        text = "nothing stands out: no health rule fired"
        if evals and not held:
            text += "; every held-out number rose"
        elif held:
            text += f"; {' and '.join(held)} moved by less than {FELL:g}"
        look.append(text)
    return Glance(_headline(evals, train, _protocol(config)), evals + train, look)


def _eval_prompts(config: Any) -> int | None:
    ev = config.get("eval") if isinstance(config, dict) else None
    n = ev.get("prompts") if isinstance(ev, dict) else None
    return int(n) if isinstance(n, (int, float)) and n > 0 else None


def _protocol(config: Any) -> str:
    ev = config.get("eval") if isinstance(config, dict) else None
    if not isinstance(ev, dict) or "prompts" not in ev or "samples" not in ev:
        return ""
    return f" ({ev['prompts']} held-out prompts × {ev['samples']} samples)"
