"""Paired comparison of training runs across seeds: arms × seeds, paired by ``run.seed``.

A *run* is a grouprl run folder: ``config.yaml`` (or ``config.json``, the resolved
configuration; its ``run.seed`` pairs runs) and ``metrics.jsonl`` (one JSON object per step).
An *arm* is a set of runs of one configuration that differ only in the seed. Every arm is
compared against a baseline arm seed by seed: for a metric at a step, the per-seed difference
d_s = arm_s − baseline_s, and over the n shared seeds

- the paired mean d̄ = Σ d_s / n and its standard error sd(d)/√n (sample sd, ddof = 1;
  NaN for one seed),
- the sign counts: in how many seeds d_s > 0, < 0 and = 0,
- a percentile bootstrap interval of d̄ (:func:`bootstrap_ci`): ``resamples`` resamples of
  the n differences with replacement, from a seeded generator.

"At the end" is each run's last logged row that holds the metric. Curves are the mean ± SE
(over an arm's runs) of a metric at each step every run of the arm logged it.

Everything here is pure (files in, plain dicts out; :func:`compare` is JSON-ready), so the
CLI (``grouprl compare``) and the reproductions share it. Bad input raises
:class:`CompareError` with what was wrong and how to fix it.
"""

from __future__ import annotations

import glob as _glob
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from grouprl._json import jsonl_lines

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "IGNORED_FIELDS",
    "CompareError",
    "Run",
    "bootstrap_ci",
    "check_configs",
    "compare",
    "curves",
    "default_metrics",
    "load_arms",
    "load_run",
    "load_sweep",
    "pair_by_seed",
    "paired_stats",
]

BOOTSTRAP_RESAMPLES = 10_000
"""Default number of bootstrap resamples of the per-seed differences."""

IGNORED_FIELDS = (
    "run.seed",
    "run.out",
    "run.resume",
    "run.resume_anyway",
    "run.overwrite",
    "run.progress",
    "run.tensorboard",
    "run.wandb",
    "run.report",
    "run.threads",
    "run.every",
    "run.keep_last",
    "run.save_final",
)
"""Config fields that may differ between the runs of one arm: the seed, and where and how a
run is kept and shown, none of which changes what it computes (``run.threads`` changes only
the order of floating-point sums)."""


class CompareError(ValueError):
    """Input that cannot be compared; the message says what and how to fix it."""


@dataclass
class Run:
    """One run folder: its path, seed, flat config (``section.field`` keys) and step rows."""

    path: Path
    seed: int
    config: dict[str, Any]
    rows: list[dict[str, float]] = field(repr=False)

    def steps_with(self, metric: str) -> list[int]:
        """The steps whose row holds a finite ``metric``."""
        return [int(r["step"]) for r in self.rows if _finite(r.get(metric))]

    def at(self, metric: str, step: int) -> float:
        """``metric`` at ``step``; CompareError naming the steps that hold it when absent."""
        for r in self.rows:
            if int(r["step"]) == step and _finite(r.get(metric)):
                return float(r[metric])
        have = self.steps_with(metric)
        raise CompareError(
            f"{self.path}: no {metric} at step {step}; it is logged at steps "
            f"{_short(have) or 'none'} (choose --at among the steps every run logs)"
        )

    def end(self, metric: str) -> tuple[int, float]:
        """(step, value) of the last row that holds ``metric``."""
        have = self.steps_with(metric)
        if not have:
            raise CompareError(f"{self.path}: {metric} is never logged")
        return have[-1], self.at(metric, have[-1])

    def metric_names(self) -> set[str]:
        return {k for r in self.rows for k, v in r.items() if k != "step" and _finite(v)}


# ---- loading ------------------------------------------------------------------------------------


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _short(xs: Sequence[Any], n: int = 12) -> str:
    xs = list(xs)
    s = ", ".join(str(x) for x in xs[:n])
    return s + (f", ... ({len(xs)} in all)" if len(xs) > n else "")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _read_config(path: Path) -> dict[str, Any]:
    for name in ("config.yaml", "config.json"):
        f = path / name
        if f.is_file():
            text = f.read_text(encoding="utf-8")
            if name.endswith(".json"):
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
            if not isinstance(data, Mapping):
                raise CompareError(f"{f}: not a mapping of config sections")
            return _flatten(data)
    raise CompareError(
        f"{path}: no config.yaml or config.json (a grouprl run folder has both config.yaml and "
        "metrics.jsonl; the seed that pairs runs is its run.seed)"
    )


def load_run(path: str | Path) -> Run:
    """One run folder (``config.yaml``/``config.json`` + ``metrics.jsonl``)."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise CompareError(f"{path}: no metrics.jsonl (is this a grouprl run folder?)")
    config = _read_config(path)
    if "run.seed" not in config:
        raise CompareError(f"{path}: its config has no run.seed, which pairs the runs")
    rows: dict[int, dict[str, float]] = {}
    for _no, obj, error in jsonl_lines(metrics, errors="replace"):
        if error is not None or not isinstance(obj, dict) or "step" not in obj:
            continue  # a torn last line of a live run: the rows before it are whole
        try:
            step = int(obj["step"])
        except (TypeError, ValueError):
            continue
        row = rows.setdefault(step, {"step": float(step)})
        row.update({k: float(v) for k, v in obj.items() if k != "step" and _finite(v)})
    return Run(path, int(config["run.seed"]), config, [rows[s] for s in sorted(rows)])


def load_arms(spec: Mapping[str, Sequence[str]]) -> dict[str, list[Run]]:
    """``{arm: [glob, ...]}`` -> ``{arm: [Run, ...]}`` (a glob matches run folders).

    A glob that matches no run folder is an error that names it; so is a folder claimed by
    two arms."""
    if not spec:
        raise CompareError("no arms: give at least two --arm NAME=GLOB, or a --sweep file")
    arms: dict[str, list[Run]] = {}
    owner: dict[Path, str] = {}
    for arm, globs in spec.items():
        found: list[Path] = []
        for g in globs:
            hits = sorted(
                Path(p) for p in _glob.glob(str(g)) if (Path(p) / "metrics.jsonl").is_file()
            )
            if not hits:
                raise CompareError(
                    f"arm {arm!r}: {g!r} matches no run folder (a folder holding "
                    "metrics.jsonl); check the path, and quote the glob so the shell leaves it"
                )
            found += hits
        runs = []
        for p in dict.fromkeys(found):
            key = p.resolve()
            if key in owner and owner[key] != arm:
                raise CompareError(f"{p} is in both arm {owner[key]!r} and arm {arm!r}")
            owner[key] = arm
            runs.append(load_run(p))
        arms[arm] = runs
    return arms


def load_sweep(path: str | Path) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """A sweep file (YAML or JSON) -> (``{arm: [glob, ...]}``, its other settings).

    Format::

        arms:                         # arm -> a run-folder pattern (or a list of them)
          grpo: runs/grpo/seed{seed}
          agpo: runs/agpo/seed{seed}
        seeds: [0, 1, 2]              # optional: fills {seed}; without it, {seed} matches any
        baseline: grpo                # optional
        metrics: [eval/pass@1]        # optional
        vary: {agpo: [algorithm.preset]}   # optional: fields allowed to differ within an arm

    The same file drives ``grouprl sweep`` when an arm also gives ``overrides`` (then its value
    is a mapping with ``runs`` and ``overrides``)."""
    path = Path(path)
    if not path.is_file():
        raise CompareError(f"sweep file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, Mapping) or not isinstance(data.get("arms"), Mapping):
        raise CompareError(f"{path}: a sweep file needs an 'arms' mapping (arm: run pattern)")
    seeds = data.get("seeds")
    spec: dict[str, list[str]] = {}
    for arm, value in data["arms"].items():
        if isinstance(value, Mapping):
            value = value.get("runs")
        pats = [value] if isinstance(value, str) else list(value or [])
        if not pats:
            raise CompareError(f"{path}: arm {arm!r} names no run pattern")
        globs = []
        for p in pats:
            if "{seed}" in p and seeds is not None:
                globs += [p.replace("{seed}", str(s)) for s in seeds]
            else:
                globs.append(p.replace("{seed}", "*"))
        spec[str(arm)] = globs
    rest = {k: v for k, v in data.items() if k != "arms"}
    return spec, rest


# ---- checks -------------------------------------------------------------------------------------


def check_configs(
    arms: Mapping[str, Sequence[Run]],
    vary: Mapping[str, Iterable[str]] | Iterable[str] = (),
    ignored: Iterable[str] = IGNORED_FIELDS,
) -> None:
    """Within each arm, every config field but the seed, the bookkeeping ones (``ignored``)
    and the arm's ``vary`` fields must be equal; else CompareError naming the field and both
    values. ``vary``: field names for every arm, or ``{arm: [field, ...]}``."""
    for arm, runs in arms.items():
        allowed = set(ignored)
        if isinstance(vary, Mapping):
            allowed |= set(vary.get(arm, ()))
        else:
            allowed |= set(vary)
        first = runs[0]
        for other in runs[1:]:
            for key in sorted(set(first.config) | set(other.config)):
                if key in allowed or any(key.startswith(a + ".") for a in allowed):
                    continue
                a, b = first.config.get(key, "<absent>"), other.config.get(key, "<absent>")
                if a != b:
                    raise CompareError(
                        f"arm {arm!r}: its runs differ in {key}: {a!r} in {first.path} but "
                        f"{b!r} in {other.path}; an arm's runs may differ only in the seed "
                        f"(pass --vary {key} if the difference is intended)"
                    )


def pair_by_seed(arm: str, runs: Sequence[Run], base: str, base_runs: Sequence[Run]):
    """``[(seed, arm run, baseline run)]`` over the seeds, sorted; CompareError when a seed
    repeats within an arm or one arm lacks a seed the other has."""
    by: dict[str, dict[int, Run]] = {}
    for name, rs in ((arm, runs), (base, base_runs)):
        seen: dict[int, Run] = {}
        for r in rs:
            if r.seed in seen:
                raise CompareError(
                    f"arm {name!r} has two runs of seed {r.seed}: {seen[r.seed].path} and "
                    f"{r.path}; an arm holds one run per seed"
                )
            seen[r.seed] = r
        by[name] = seen
    a, b = set(by[arm]), set(by[base])
    if a != b:
        parts = []
        if b - a:
            parts.append(f"arm {arm!r} lacks seed(s) {_short(sorted(b - a))}")
        if a - b:
            parts.append(f"arm {base!r} lacks seed(s) {_short(sorted(a - b))}")
        raise CompareError(
            "unpaired seeds: " + "; ".join(parts) + " (run the missing seeds, or leave the "
            "extra runs out of the globs)"
        )
    return [(s, by[arm][s], by[base][s]) for s in sorted(a)]


def default_metrics(arms: Mapping[str, Sequence[Run]]) -> list[str]:
    """The eval pass@k keys every run logs, by k; CompareError when there are none."""
    common = set.intersection(*(r.metric_names() for rs in arms.values() for r in rs))
    found = [m for m in common if re.fullmatch(r"eval/pass@\d+", m)]
    if not found:
        raise CompareError(
            "no eval/pass@k metric is logged by every run; choose one with --metric among: "
            f"{_short(sorted(common), 40) or 'none'}"
        )
    return sorted(found, key=lambda m: int(m.rsplit("@", 1)[1]))


def _check_metrics(arms: Mapping[str, Sequence[Run]], metrics: Sequence[str]) -> None:
    for rs in arms.values():
        for r in rs:
            names = r.metric_names()
            for m in metrics:
                if m not in names:
                    raise CompareError(
                        f"{r.path}: metric {m!r} is not logged; it logs: "
                        f"{_short(sorted(names), 40)}"
                    )


# ---- statistics ---------------------------------------------------------------------------------


def bootstrap_ci(
    d: Sequence[float] | np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``d`` ``[n]``.

    ``resamples`` means of n draws with replacement (``numpy.random.default_rng(seed)``),
    then their (1 − level)/2 and (1 + level)/2 quantiles (numpy's linear interpolation).
    Efron & Tibshirani (1993), §13.3. With n = 1 the interval is the point."""
    x = np.asarray(d, dtype=float)  # [n]
    if x.ndim != 1 or x.size == 0:
        raise CompareError("bootstrap_ci needs a non-empty 1-D sequence of differences")
    if not 0 < level < 1:
        raise CompareError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise CompareError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))  # [B, n]
    means = x[idx].mean(axis=1)  # [B]
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_stats(
    d: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean, SE (sd ddof 1 / √n; NaN for n = 1), sign counts and bootstrap CI of ``d`` ``[n]``."""
    x = np.asarray(d, dtype=float)  # [n]
    n = int(x.size)
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    lo, hi = bootstrap_ci(x, resamples, level, seed)
    return {
        "n": n,
        "mean": float(x.mean()),
        "se": se,
        "positive": int((x > 0).sum()),
        "negative": int((x < 0).sum()),
        "zero": int((x == 0).sum()),
        "ci_low": lo,
        "ci_high": hi,
        "diffs": [float(v) for v in x],
    }


def curves(runs: Sequence[Run], metric: str) -> dict[str, list[float]]:
    """``{"step", "mean", "se", "n"}`` of ``metric`` over ``runs`` at each step all of them
    log (SE = sd ddof 1 / √n; 0 for one run)."""
    if not runs:
        return {"step": [], "mean": [], "se": [], "n": []}
    steps = sorted(set.intersection(*(set(r.steps_with(metric)) for r in runs)))
    vals = np.array([[r.at(metric, s) for s in steps] for r in runs])  # [R, S]
    n = len(runs)
    se = vals.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(len(steps))
    return {
        "step": [int(s) for s in steps],
        "mean": [float(v) for v in vals.mean(axis=0)] if steps else [],
        "se": [float(v) for v in se],
        "n": [n] * len(steps),
    }


def compare(
    arms: Mapping[str, Sequence[Run]],
    metrics: Sequence[str] | None = None,
    baseline: str | None = None,
    at: Sequence[int] = (),
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
    vary: Mapping[str, Iterable[str]] | Iterable[str] = (),
) -> dict[str, Any]:
    """Every arm against ``baseline`` (default: the first arm), paired by seed, for each of
    ``metrics`` (default :func:`default_metrics`) at each step of ``at`` and at the end.

    Returns (JSON-ready)::

        {"baseline", "metrics", "at", "bootstrap": {"resamples", "level", "seed", "method"},
         "arms": {arm: {"runs": [path], "seeds": [int]}},
         "comparisons": [{"arm", "baseline", "metric", "seeds",
                          "steps": {"<step>": stats}, "end": stats + {"steps": [int]}}],
         "curves": {arm: {metric: {"step", "mean", "se", "n"}}}, "notes": [str]}

    where stats = :func:`paired_stats` of arm − baseline over the seeds."""
    if not arms or any(not rs for rs in arms.values()):
        empty = [a for a, rs in arms.items() if not rs]
        raise CompareError(f"arm(s) {empty} hold no runs" if empty else "no arms to compare")
    names = list(arms)
    if len(names) < 2:
        raise CompareError(f"only one arm ({names[0]!r}): a comparison needs two or more")
    baseline = names[0] if baseline is None else baseline
    if baseline not in arms:
        raise CompareError(f"baseline {baseline!r} is not an arm; the arms: {', '.join(names)}")
    check_configs(arms, vary)
    metrics = list(metrics) if metrics else default_metrics(arms)
    _check_metrics(arms, metrics)
    notes: list[str] = []
    comparisons = []
    for arm in names:
        if arm == baseline:
            continue
        pairs = pair_by_seed(arm, arms[arm], baseline, arms[baseline])
        for m in metrics:
            steps = {}
            for s in at:
                d = [x.at(m, int(s)) - y.at(m, int(s)) for _, x, y in pairs]
                steps[str(int(s))] = paired_stats(d, resamples, level, seed)
            ends = [(x.end(m), y.end(m)) for _, x, y in pairs]
            end_steps = sorted({e[0] for pair in ends for e in pair})
            if len(end_steps) > 1:
                notes.append(
                    f"{arm} vs {baseline}, {m}: the runs end at different steps "
                    f"({_short(end_steps)}); 'end' pairs each run's last value"
                )
            end = paired_stats([a[1] - b[1] for a, b in ends], resamples, level, seed)
            comparisons.append(
                {
                    "arm": arm,
                    "baseline": baseline,
                    "metric": m,
                    "seeds": [s for s, _, _ in pairs],
                    "steps": steps,
                    "end": {**end, "steps": end_steps},
                }
            )
    return {
        "baseline": baseline,
        "metrics": metrics,
        "at": [int(s) for s in at],
        "bootstrap": {
            "resamples": resamples,
            "level": level,
            "seed": seed,
            "method": "percentile",
        },
        "arms": {
            a: {"runs": [str(r.path) for r in rs], "seeds": sorted(r.seed for r in rs)}
            for a, rs in arms.items()
        },
        "comparisons": comparisons,
        "curves": {a: {m: curves(rs, m) for m in metrics} for a, rs in arms.items()},
        "notes": notes,
    }
