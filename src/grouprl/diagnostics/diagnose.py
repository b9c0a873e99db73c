"""Offline diagnosis of reward groups: the engine behind ``grouprl diagnose``.

Input: a JSONL file of groups, one per line, ``{"prompt_id": ..., "rewards": [...],
"step": optional}`` (rewards are numbers; ``null`` = NaN = unscorable), or a grouprl run
folder (``rewards.jsonl`` in that format, ``metrics.jsonl``). Output: a :class:`Diagnosis`
with per-step ACR and split, inverse-scale tails of the main estimators, tail-miss risk and
group-size advice, normalisation-regime numbers and the health warnings a live run would
have raised.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grouprl._json import jsonl_lines
from grouprl.diagnostics.acr import DEFAULT_TAU, collapse_split
from grouprl.diagnostics.health import RunHealth
from grouprl.diagnostics.inverse_scale import updated_groups
from grouprl.diagnostics.regime import sigma_mean_cv
from grouprl.diagnostics.tailmiss import (
    DEFAULT_CANDIDATES,
    GroupSizeAdvice,
    advise_group_size,
    p_active,
    tail_miss_probability,
)

__all__ = [
    "SCALE_ESTIMATORS",
    "Diagnosis",
    "GroupFile",
    "diagnose_groups",
    "load_groups",
]

SCALE_ESTIMATORS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("grpo", {}),
    "rloo": ("rloo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
    "p90": ("p90", {}),
    "maxnorm_rloo+delta_res": ("maxnorm_rloo", {"delta_res": 1e-2}),
}
"""Label -> (estimator, keywords) whose inverse-scale tails ``diagnose`` reports."""

MAX_ERRORS_KEPT = 1000
"""Malformed lines listed individually (all are counted) [OURS]."""


@dataclass
class GroupFile:
    """Parsed groups: ``batches[step] = (prompt_ids, rewards [P, G])`` plus skipped lines."""

    path: Path
    batches: dict[Any, tuple[list[Any], torch.Tensor]]
    errors: list[tuple[int, str]]
    n_errors: int
    n_lines: int

    @property
    def n_groups(self) -> int:
        return sum(r.shape[0] for _, r in self.batches.values())


def _parse_line(obj: Any) -> tuple[Any, Any, list[float]]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "rewards" not in obj:
        raise ValueError('no "rewards" key')
    rewards = obj["rewards"]
    if not isinstance(rewards, list) or not rewards:
        raise ValueError('"rewards" must be a non-empty list of numbers')
    vals = []
    for v in rewards:
        if v is None:
            vals.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isinf(v):
                raise ValueError("infinite reward (a verifier must return a finite score or null)")
            vals.append(float(v))
        else:
            raise ValueError(f"reward {v!r} is not a number or null")
    step = obj.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f'"step" must be an integer, got {step!r}')
    return step, obj.get("prompt_id"), vals


def load_groups(path: str | Path) -> GroupFile:
    """Parse a groups JSONL; malformed lines are skipped, counted and kept with their number.

    Ragged groups are padded with NaN to the longest group of their step (NaN = missing,
    ALGORITHMS.md §0). Lines without ``"step"`` form one batch (key ``None``). Raises
    FileNotFoundError / ValueError for a missing, unreadable or group-less file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    by_step: dict[Any, tuple[list[Any], list[list[float]]]] = {}
    errors: list[tuple[int, str]] = []
    n_err = n_lines = 0
    try:
        for no, obj, error in jsonl_lines(path):
            n_lines += 1
            try:
                if error is not None:
                    raise ValueError(error)
                step, pid, vals = _parse_line(obj)
            except (ValueError, TypeError) as err:
                n_err += 1
                if len(errors) < MAX_ERRORS_KEPT:
                    errors.append((no, str(err)))
                continue
            ids, rows = by_step.setdefault(step, ([], []))
            ids.append(pid if pid is not None else f"line{no}")
            rows.append(vals)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err})") from None
    if not by_step:
        what = "is empty" if n_lines == 0 else f"has no valid group ({n_err} malformed lines)"
        raise ValueError(
            f'{path} {what}: expected lines like {{"prompt_id": 1, "rewards": [0, 1, 1, 0]}}'
        )
    batches = {}
    for step in sorted(by_step, key=lambda s: (s is None, s if s is not None else 0)):
        ids, rows = by_step[step]
        g = max(len(r) for r in rows)
        t = torch.full((len(rows), g), math.nan, dtype=torch.float64)
        for i, r in enumerate(rows):  # parsing, not a hot path
            t[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        batches[step] = (ids, t)
    return GroupFile(path, batches, errors, n_err, n_lines)


@dataclass
class Diagnosis:
    """Everything ``grouprl diagnose`` prints and plots."""

    steps: list[dict[str, Any]]
    scale: list[dict[str, Any]]
    advice: GroupSizeAdvice | None
    group_size: int
    current: dict[str, float]
    warnings: list[str]
    totals: dict[str, Any]
    mu: list[float] = field(default_factory=list)


def _step_row(step, rewards, tau, reward_range) -> dict[str, Any]:
    split = collapse_split(rewards, tau=tau, reward_range=reward_range)
    valid = ~torch.isnan(rewards)
    s_mean, s_cv = sigma_mean_cv(split["sigma"], ~split["collapsed"])
    lo, hi = reward_range
    return {
        "step": step if step is not None else "-",
        "groups": rewards.shape[0],
        "G": rewards.shape[1],
        "reward/mean": float(rewards[valid].mean()) if valid.any() else math.nan,
        "acr/rate": float(split["collapsed"].double().mean()),
        "acr/all_correct": float(split["all_correct"].double().mean()),
        "acr/all_wrong": float(split["all_wrong"].double().mean()),
        "acr/other": float(split["other"].double().mean()),
        "reward/nan_count": int((~valid).sum()),
        "reward/nan_frac": float((~valid).double().mean()),
        "regime/sigma_mean": float(s_mean),
        "regime/sigma_cv": float(s_cv),
        "_range_ok": bool(((rewards[valid] >= lo - 1e-9) & (rewards[valid] <= hi + 1e-9)).all()),
    }


def _scale_tails(batches, reward_range) -> tuple[list[dict[str, Any]], dict[int, float]]:
    from grouprl import advantages

    rows, grpo_p99 = [], {}
    for label, (name, kw) in SCALE_ESTIMATORS.items():
        inv, upd_n, keep_n, total = [], 0, 0, 0
        for i, (_, rewards) in enumerate(batches.values()):
            adv = advantages.compute(name, rewards, reward_range=reward_range, **kw)
            upd = updated_groups(adv)
            inv.append((1.0 / adv.scale.double())[upd])
            if label == "grpo":
                v = (1.0 / adv.scale.double())[upd]
                grpo_p99[i] = float(torch.quantile(v, 0.99)) if v.numel() else 0.0
            upd_n += int(upd.sum())
            keep_n += int(adv.keep.sum())
            total += rewards.shape[0]
        v = torch.cat(inv)
        q = (
            torch.quantile(v, torch.tensor([0.5, 0.95, 0.99], dtype=v.dtype)).tolist()
            if v.numel()
            else [math.nan] * 3
        )
        rows.append(
            {
                "estimator": label,
                "updated groups": upd_n / max(total, 1),
                "skipped (keep=False)": 1 - keep_n / max(total, 1),
                "inv P50": q[0],
                "inv P95": q[1],
                "inv P99": q[2],
                "inv max": float(v.max()) if v.numel() else math.nan,
            }
        )
    return rows, grpo_p99


def _success_estimates(batches, reward_range) -> tuple[torch.Tensor, int]:
    """Per-prompt success μ̂ (mean normalised reward, pooled over steps by prompt_id) and G."""
    lo, hi = reward_range
    sums: dict[Any, float] = {}
    counts: dict[Any, int] = {}
    g = 0
    for ids, rewards in batches.values():
        g = max(g, rewards.shape[1])
        valid = ~torch.isnan(rewards)
        norm = ((torch.where(valid, rewards, torch.zeros_like(rewards)) - lo) / (hi - lo)).clamp(
            0, 1
        )
        s = (norm * valid).sum(1).tolist()
        c = valid.sum(1).tolist()
        for pid, si, ci in zip(ids, s, c):
            key = json.dumps(pid, sort_keys=True, default=str)
            sums[key] = sums.get(key, 0.0) + si
            counts[key] = counts.get(key, 0) + ci
    mu = [sums[k] / counts[k] for k in sums if counts[k] > 0]
    return torch.tensor(mu, dtype=torch.float64), g


def diagnose_groups(
    groups: GroupFile,
    *,
    reward_range: tuple[float, float] = (0.0, 1.0),
    tau: float = DEFAULT_TAU,
    rho: float = 0.1,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
) -> Diagnosis:
    """Per-step ACR and split, scale tails, tail-miss advice and replayed health warnings."""
    lo, hi = float(reward_range[0]), float(reward_range[1])
    if not hi > lo:
        raise ValueError(f"reward_range must be (lo, hi) with hi > lo, got {reward_range}")
    steps = [_step_row(s, r, tau, (lo, hi)) for s, (_, r) in groups.batches.items()]
    scale_rows, grpo_p99 = _scale_tails(groups.batches, (lo, hi))
    health = RunHealth()
    warnings: list[str] = []
    for i, row in enumerate(steps):
        metrics = {k: float(v) for k, v in row.items() if "/" in k}
        metrics["scale/inv_p99"] = grpo_p99.get(i, 0.0)
        s = row["step"] if isinstance(row["step"], int) else i
        warnings += health.update(s, metrics)
    out_of_range = sum(not r.pop("_range_ok") for r in steps)
    if out_of_range:
        warnings.append(
            f"[reward_range] {out_of_range} step(s) have rewards outside [{lo:g}, {hi:g}] -> pass "
            "--reward-range LO HI so all-correct / all-wrong are read correctly"
        )
    mu, g = _success_estimates(groups.batches, (lo, hi))
    advice = advise_group_size(mu, rho, candidates=candidates) if mu.numel() else None
    current = {}
    if mu.numel() and g >= 1:
        current = {
            "G": g,
            "expected active": float(p_active(mu, g).mean()),
            "expected tail miss": float(tail_miss_probability(mu, rho * mu, g).mean()),
        }
    n_groups = groups.n_groups
    totals = {
        "lines": groups.n_lines,
        "groups": n_groups,
        "malformed lines": groups.n_errors,
        "steps": len(steps),
        "ACR (all groups)": sum(r["acr/rate"] * r["groups"] for r in steps) / max(n_groups, 1),
        "ACR cumulative (mean over steps)": health.acr_cumulative,
        "ACR_100": health.acr_100,
        "NaN rewards": sum(r["reward/nan_count"] for r in steps),
    }
    return Diagnosis(steps, scale_rows, advice, g, current, warnings, totals, mu.tolist())
